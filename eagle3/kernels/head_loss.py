"""The draft head and its loss as one op: logits, soft cross-entropy, argmax and the logits' gradient.

The TTT loss is ``sum_n w_n * CE_n`` over the draft head's rows, ``CE_n`` the soft cross-entropy of
row n's logits against its target distribution (:func:`eagle3.train.loss.soft_cross_entropy_rows`).
Left to autograd, the head writes the bf16 logits (S x rows x draft vocabulary: 0.9 GB at the 8B
shape), a reduction reads them for the loss and the argmax, and the backward reads them and the
targets again to write their gradient, in kernels Inductor generates around cuBLAS's.
``eagle3::head_soft_ce`` computes the logits with one matmul and then, per row, in one Triton
kernel: the log-sum-exp, ``<p, x>``, ``sum(p)``, the argmax, and the gradient of ``w_n * CE_n``,
``w_n * (softmax(x) * sum(p) - p)``, written over the logits in place. The gradient is known in the
forward because the loss is linear in the rows' CE with weights the forward already has; the
backward (``eagle3::head_soft_ce_backward``) only multiplies it into the head's two gradient
matmuls and scales their results by the loss's incoming gradient (1 in the train loop; the factor
comes after the matmuls' bf16 rounding, an ulp away from scaling before). The logits are never
kept beside their gradient: the op holds one [rows, vocabulary] buffer where autograd held two.

Where a row's target is: the op takes the targets' rows once (``target`` [R, V]) and an index per
logits row (``target_rows``), so the TTT steps' shifted windows of one target row are read in place,
not gathered into copies.

``train.head_loss`` (:func:`resolve`): ``fused`` runs the op (its Triton kernel on CUDA; on CPU a
torch implementation of the same arithmetic, which the CPU tests run), ``unfused`` the logits and
loss as plain torch code for Inductor, ``auto`` the op on CUDA where Triton imports, else unfused.
Both ops do all their work at run time, from this file's code: the compiled TTT graph holds only
their calls. (Work traced from an op's autograd formula into the compiled backward can outlive a
change to that formula: Inductor's on-disk AOTAutograd cache is keyed by the forward graph, where
the op is one node.)

Measured against the unfused loss: bench/results/head_loss_h200_202612.md.
"""
from __future__ import annotations

import functools
from typing import Tuple

import torch
from torch import Tensor

CHOICES = ("auto", "fused", "unfused")
CHUNK, WARPS = 4096, 8
"""The kernel's chunk of a row and the warps of its program (one row): the fastest of the forms
timed at the 8B shape (bench/results/head_loss_h200_202612.md)."""


@functools.lru_cache(maxsize=None)
def _kernel():
    """The Triton kernel, or None where Triton cannot be imported."""
    try:
        from eagle3.kernels._head_loss_kernels import soft_ce_kernel
    except Exception:  # noqa: BLE001 - any import failure means: not here
        return None
    return soft_ce_kernel


def resolve(name: str, device: torch.device) -> str:
    """``train.head_loss`` on ``device``: fused | unfused."""
    if name not in CHOICES:
        raise ValueError(f"train.head_loss={name!r} is not one of {', '.join(CHOICES)}")
    if name == "auto":
        return "fused" if device.type == "cuda" and _kernel() is not None else "unfused"
    if name == "fused" and device.type == "cuda" and _kernel() is None:
        raise ValueError("train.head_loss=fused runs a Triton kernel on CUDA, and Triton does not import here: "
                         "install triton (torch's CUDA wheels bring it) or use train.head_loss=unfused")
    return name


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _soft_ce_torch(logits: Tensor, target: Tensor, target_rows: Tensor, weights: Tensor) -> Tuple[Tensor, Tensor]:
    """The kernel's arithmetic in torch (CPU): (CE [N], argmax [N]); logits overwritten with the gradient."""
    acc = _acc(logits.dtype)
    x = logits.to(acc)
    p = target[target_rows].to(acc)
    lse = torch.logsumexp(x, dim=-1)
    ps = p.sum(-1)
    ce = lse * ps - (p * x).sum(-1)
    arg = x.argmax(-1)
    logits.copy_(weights.to(acc)[:, None] * (torch.exp(x - lse[:, None]) * ps[:, None] - p))
    return ce, arg


def _soft_ce_triton(logits: Tensor, target: Tensor, target_rows: Tensor, weights: Tensor) -> Tuple[Tensor, Tensor]:
    kernel = _kernel()
    N, V = logits.shape
    ce = torch.empty(N, dtype=torch.float32, device=logits.device)
    arg = torch.empty(N, dtype=torch.int64, device=logits.device)
    if N:
        kernel[(N,)](logits, target, target_rows, weights.float(), ce, arg, V, logits.stride(0), target.stride(0),
                     BLOCK=CHUNK, num_warps=WARPS)
    return ce, arg


@torch.library.custom_op("eagle3::head_soft_ce", mutates_args=())
def head_soft_ce(x: Tensor, w: Tensor, target: Tensor, target_rows: Tensor,
                 weights: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """x [N, H] the head's (normed) input rows, w [V, H] its weight, target [R, V] the target
    distributions, target_rows [N] int64 (row n's target is target[target_rows[n]]), weights [N]
    (the loss's weight of each row; 0 for rows without loss). -> (loss = sum_n weights_n CE_n, CE
    [N], argmax [N] int64, the gradient of the loss with respect to the logits [N, V] in x's dtype).
    CE, the loss and the arithmetic in float32 (float64 for float64 inputs)."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1] or target.shape[-1] != w.shape[0]:
        raise ValueError(f"head_soft_ce: x {tuple(x.shape)}, w {tuple(w.shape)}, target {tuple(target.shape)} "
                         "do not fit ([N, H], [V, H], [R, V])")
    logits = torch.mm(x, w.t())
    target = target.contiguous()
    if x.device.type == "cuda":
        if x.dtype == torch.float64:
            raise ValueError("head_soft_ce's CUDA kernel computes in float32: use train.head_loss=unfused for float64")
        ce, arg = _soft_ce_triton(logits, target, target_rows, weights)
    else:
        ce, arg = _soft_ce_torch(logits, target, target_rows, weights)
    return (ce * weights.to(ce.dtype)).sum(), ce, arg, logits


@head_soft_ce.register_fake
def _(x, w, target, target_rows, weights):
    N, acc = x.shape[0], _acc(x.dtype)
    return (x.new_empty((), dtype=acc), x.new_empty((N,), dtype=acc), x.new_empty((N,), dtype=torch.int64),
            x.new_empty((N, w.shape[0])))


def _scale(x: Tensor, g: Tensor) -> Tensor:
    return (x * g).to(x.dtype)


@functools.lru_cache(maxsize=None)
def _compiled_scale():
    return torch.compile(_scale, dynamic=None)


@torch.library.custom_op("eagle3::head_soft_ce_backward", mutates_args=())
def head_soft_ce_backward(grad: Tensor, dlogits: Tensor, x: Tensor, w: Tensor) -> Tuple[Tensor, Tensor]:
    """grad: the loss's incoming gradient (0-dim); dlogits [N, V] the op's gradient of the loss;
    -> (dx [N, H], dw [V, H]), in x's and w's dtype."""
    g = grad.to(_acc(dlogits.dtype))
    # the factor on the smaller operands: the [N, H] rows before dw's matmul, dx after its own (one
    # compiled kernel each on CUDA: aten's multiply by a 0-dim device tensor ran at a quarter of
    # the bandwidth there)
    scale = _compiled_scale() if x.device.type == "cuda" else _scale
    dw = torch.mm(dlogits.t(), scale(x, g))
    dx = scale(torch.mm(dlogits, w), g)
    return dx, dw.to(w.dtype)


@head_soft_ce_backward.register_fake
def _(grad, dlogits, x, w):
    return torch.empty_like(x), torch.empty_like(w)


def _setup_context(ctx, inputs, output):
    x, w = inputs[0], inputs[1]
    ctx.save_for_backward(output[3], x, w)
    ctx.mark_non_differentiable(output[1], output[2], output[3])


def _backward(ctx, grad_loss, grad_ce, grad_arg, grad_dlogits):
    dlogits, x, w = ctx.saved_tensors
    dx, dw = torch.ops.eagle3.head_soft_ce_backward(grad_loss, dlogits, x, w)
    return dx, dw, None, None, None


head_soft_ce.register_autograd(_backward, setup_context=_setup_context)
