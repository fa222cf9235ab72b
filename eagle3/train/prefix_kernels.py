"""The TTT prefix attention on cuDNN's fused attention, with the gradient of its log-sum-exp.

Every TTT step attends over the step-0 keys (the document-causal prefix) and merges the diagonals in
by the prefix's log-sum-exp (eagle3.train.attention.merge_diagonals), so the loss depends on that
log-sum-exp and its backward needs the gradient through it. ``train.attention=cudnn`` runs that
prefix on cuDNN's fused attention (``aten._scaled_dot_product_cudnn_attention`` and its backward):
causal, with the documents of a packed row kept apart by an additive bias (:func:`doc_bias`:
0 within a document, :data:`MASKED` across), and no bias at all where every row is one document.
The key/value heads are repeated to the query heads for the kernel and their gradients summed back.
The ``cpu`` kernel is torch's CPU flash kernel with the same bias (tests: the same path through a
real kernel where no GPU is).

Neither backward kernel takes a log-sum-exp gradient. Each computes its softmax backward as
``dS = P * (dP - D)`` with ``D = rowsum(dO * O)`` from the output it is handed, and the gradient
through ``lse`` adds ``P * dlse``: so ``D - dlse`` is what it needs. :func:`fold_lse_grad` hands the
kernel ``O' = O - dlse * dO / |dO|^2`` per (row, head, token), whose ``rowsum(dO * O')`` is
``D - dlse``; ``O`` enters that backward nowhere else. Exact in real arithmetic; in bf16 the one
rounding of ``O'`` moves ``D - dlse`` by about 2^-9 of the correction over sqrt(head dim), the size
of the rounding the bf16 output already carries. Where a token's ``dO`` is zero its ``dlse`` must be
zero as well (the merge's two gradients both carry the prefix's weight: they are), and it is
handed ``O`` unchanged.

Tried and not kept (bench/results/prefix_kernels_h200_202612.md): torch's FlashAttention-2 over the
documents as variable-length sequences was slower than flex on the H200, and cuDNN's own
variable-length form took 74 ms a call there.

Both directions are custom ops (``eagle3::prefix_attention``, ``eagle3::prefix_attention_backward``)
with fake implementations: ``torch.compile`` keeps them whole inside the compiled TTT graph, and
all they do runs at run time (the note above the ops says why).
"""
from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch

KERNELS = ("cudnn", "cpu")
MASKED = -30000.0
"""The bias across documents: finite (a kernel's running max never meets -inf), and exp(MASKED +
any score) is 0 in float32."""


def doc_bias(doc_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, T, T] additive bias: 0 where query and key are of one document, :data:`MASKED`
    elsewhere (the kernel applies causality itself). B * T^2 * 2 bytes in bf16: 8 MiB a row of
    2048 tokens, 512 MiB a row of 16384."""
    same = doc_ids[:, :, None] == doc_ids[:, None, :]
    return torch.where(same, 0.0, MASKED).to(dtype)[:, None]


def one_doc_per_row(doc_ids: torch.Tensor) -> bool:
    """Whether every row of a batch [B, T] is one document (then no bias is needed; a device sync
    where doc_ids are on the device)."""
    return bool((doc_ids == doc_ids[:, :1]).all())


def fold_lse_grad(out: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor) -> torch.Tensor:
    """``O'`` with ``rowsum(dO * O') == rowsum(dO * O) - dlse`` over the last dim (module
    docstring). out, dout [..., D]; dlse [...] float32. -> out's shape and dtype."""
    d = dout.float()
    n2 = (d * d).sum(-1)
    c = torch.where(n2 > 0, dlse / n2.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    return (out.float() - c[..., None] * d).to(out.dtype)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: str) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"prefix attention kernel {kernel!r} is not one of {', '.join(KERNELS)}")
    if q.shape[-1] != v.shape[-1] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"the {kernel} prefix kernel needs one head dim for q, k and v (got {q.shape[-1]}, "
                         f"{k.shape[-1]}, {v.shape[-1]}): use train.attention=flex (an MLA draft's v is narrower)")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} KV heads")
    if kernel == "cudnn" and q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"train.attention=cudnn computes in bf16 or fp16, not {q.dtype}: train with "
                         "train.mixed_precision=auto or bf16, or use train.attention=flex")


def _like(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """x in ref's memory layout (a copy only where the strides differ)."""
    return x if x.stride() == ref.stride() else torch.empty_like(ref).copy_(x)


def _empty_state(device):
    # what the kernels take for dropout's RNG state (dropout is 0 here)
    return torch.zeros(2, dtype=torch.uint64, device=device), torch.zeros((), dtype=torch.uint64, device=device)


# Everything the custom ops do runs at run time, from this file's code: the compiled TTT graph holds
# only their calls. (With the fold and the K/V repeat in the autograd formula instead, torch.compile
# traced them into the step's backward, and Inductor's on-disk AOTAutograd cache then served a
# backward traced from an older formula to a process whose formula had changed: the cache key is the
# forward graph, where the op is one node. A changed formula must never meet a stale backward.)

@functools.lru_cache(maxsize=None)
def _compiled_fold():
    return torch.compile(fold_lse_grad, dynamic=False)


def _repeat_kv(x: torch.Tensor, g: int) -> torch.Tensor:
    """K or V [B, Hkv, T, D] repeated to the query heads, [B, T, H, D] in memory (cuDNN's fast
    layout, and the draft's own)."""
    x = x.transpose(1, 2)
    return (x if g == 1 else x.repeat_interleave(g, dim=2)).contiguous().transpose(1, 2)


def _sum_groups(dx: torch.Tensor, g: int) -> torch.Tensor:
    """The gradient of :func:`_repeat_kv`: [B, H, T, D] -> [B, H/g, T, D], each group of g summed."""
    B, H, T, D = dx.shape
    return dx if g == 1 else dx.transpose(1, 2).reshape(B, T, H // g, g, D).sum(3).transpose(1, 2)


def _bthd(x: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D] with [B, T, H, D] in memory (a copy only where it is laid out otherwise)."""
    return x if x.transpose(1, 2).is_contiguous() else x.transpose(1, 2).contiguous().transpose(1, 2)


@torch.library.custom_op("eagle3::prefix_attention", mutates_args=())
def prefix_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor],
                        scale: float, kernel: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """Causal attention, the keys limited by ``bias`` (:func:`doc_bias`, or None). q [B, Hq, T, D],
    k, v [B, Hkv, T, D] -> (out [B, Hq, T, D] in q's layout, lse [B, Hq, T] float32, natural log
    of scale * q.k)."""
    _check(q, k, v, kernel)
    B, H, T, D = q.shape
    g = H // k.shape[1]
    qk, kk, vk = _bthd(q), _repeat_kv(k, g), _repeat_kv(v, g)
    if kernel == "cudnn":
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(qk, kk, vk, bias, True, 0.0, True, False, scale=scale)
        out, lse = res[0], res[1]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qk, kk, vk, 0.0, True, attn_mask=bias,
                                                                              scale=scale)
    return _like(out, q), lse.reshape(B, H, T).float().contiguous()


@prefix_attention_op.register_fake
def _(q, k, v, bias, scale, kernel):
    B, H, T, D = q.shape
    return torch.empty_like(q), q.new_empty((B, H, T), dtype=torch.float32)


@torch.library.custom_op("eagle3::prefix_attention_backward", mutates_args=())
def prefix_attention_backward_op(dout: torch.Tensor, dlse: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor,
                                 v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, bias: Optional[torch.Tensor],
                                 scale: float, kernel: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of :func:`prefix_attention_op`, each in its input's layout, from the gradients of
    its output and (None: none) of its log-sum-exp, folded into the output the kernel reads
    (:func:`fold_lse_grad`, compiled: one kernel)."""
    B, H, T, D = q.shape
    g = H // k.shape[1]
    if dlse is not None:
        out = _compiled_fold()(out, dout, dlse)
    qk, kk, vk = _bthd(q), _repeat_kv(k, g), _repeat_kv(v, g)
    dout, out = _like(dout, qk), _like(out, qk)  # the kernels read dO and O in q's layout
    if kernel == "cudnn":
        seed, offset = _empty_state(q.device)
        # the backward takes a bias tensor always; one broadcast zero stands for none
        b = bias if bias is not None else torch.zeros(1, 1, 1, 1, dtype=q.dtype, device=q.device)
        # cum_seq_q/k: None (undefined), as the dense forward returns them; a defined one means nested
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout, qk, kk, vk, out, lse.view(B, H, T, 1), seed, offset, b, None, None, T, T, 0.0, True, scale=scale)
    else:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, qk, kk, vk, out, lse, 0.0, True, attn_mask=bias, scale=scale)
    return _like(dq, q), _like(_sum_groups(dk, g), k), _like(_sum_groups(dv, g), v)


@prefix_attention_backward_op.register_fake
def _(dout, dlse, q, k, v, out, lse, bias, scale, kernel):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, bias, scale, kernel = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, bias)
    ctx.args = (scale, kernel)


def _autograd_backward(ctx, dout, dlse):
    q, k, v, out, lse, bias = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = prefix_attention_backward_op(dout, dlse, q, k, v, out, lse, bias, *ctx.args)
    return dq, dk, dv, None, None, None


prefix_attention_op.register_autograd(_autograd_backward, setup_context=_setup_context)


def prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor], scale: float,
                     kernel: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """The document-causal prefix: q [B, Hq, T, D], k, v [B, Hkv, T, D]; ``bias``: :func:`doc_bias`
    of the batch, or None where every row is one document -> (out [B, Hq, T, D], lse [B, Hq, T]
    float32), as ``flex_attention`` with the prefix block mask and ``AuxRequest(lse=True)`` gives them."""
    return prefix_attention_op(q, k, v, bias, float(scale), kernel)
