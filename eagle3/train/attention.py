"""Attention of the training-time test (TTT).

Step j's query at index t sees the step-0 keys 0..t of its own document (the causal prefix the
target's features produced) and the keys of steps 1..j at index t (the draft's own earlier
guesses for that position: the diagonals). This is what vLLM's KV cache holds when the draft runs
its j-th token at position t+j.

Three implementations:
- ``flex`` (CUDA default): the prefix and the diagonals apart. ``flex_attention`` over the step-0
  keys alone with the (document-)causal block mask, the same for every step, returning its
  log-sum-exp; the j diagonal scores are one dot product per query each; both are merged exactly
  by their log-sum-exps (one softmax over [lse_prefix, s_1..s_j]). The kernel then computes only
  the causal blocks: with the diagonals inside one flex call each diagonal cost a whole 128x128
  block per query block (at T=2048 and 7 steps, 1288 blocks instead of 952), and the keys of all
  steps had to be concatenated every step.
- ``flex_stacked``: the keys of all steps along one axis (key ``i*T + s`` is step i, index s),
  one ``flex_attention`` call per step with a block-sparse mask over ``num_steps*T`` keys (unused
  steps zeros and masked, so every step has one shape). Kept for benchmarking against ``flex``.
- ``sdpa`` (CPU default): ``scaled_dot_product_attention`` with a dense boolean mask over
  ``(j+1)*T`` keys.
"""
from __future__ import annotations

import functools
from typing import List, Optional

import torch
import torch.nn.functional as F

BACKENDS = ("flex", "flex_stacked", "sdpa")


def resolve_backend(name: str, device: torch.device) -> str:
    """auto -> flex on CUDA (fused, compiled kernel), sdpa elsewhere (flex runs unfused on CPU)."""
    if name == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    if name not in BACKENDS:
        raise ValueError(f"train.attention={name!r} is not one of 'auto', " + ", ".join(f"'{b}'" for b in BACKENDS))
    return name


@functools.lru_cache(maxsize=None)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _flex_attention(device: torch.device):
    if torch.compiler.is_compiling():  # inside a compiled graph: traced (and fused) there
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention
    if device.type == "cuda":
        return _compiled_flex()
    import warnings

    from torch.nn.attention.flex_attention import flex_attention

    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    return flex_attention


class TTTMask:
    """The TTT attention masks of one batch, for every step.

    ``doc_ids`` [B, T]: document of each position (packed rows hold several; padding has its own
    id), so queries never see another document's prefix.
    """

    def __init__(self, doc_ids: torch.Tensor, num_steps: int, backend: str, block_size: int = 128):
        self.doc_ids = doc_ids
        self.num_steps = num_steps
        self.backend = backend
        self.block_size = block_size
        self.B, self.T = doc_ids.shape
        self._cache: dict = {}

    def dense(self, j: int) -> torch.Tensor:
        """Boolean mask [B, 1, T, (j+1)*T] (True = attend)."""
        if ("dense", j) not in self._cache:
            T, dev = self.T, self.doc_ids.device
            q = torch.arange(T, device=dev)
            same_doc = self.doc_ids[:, :, None] == self.doc_ids[:, None, :]
            prefix = same_doc & (q[None, :, None] >= q[None, None, :])
            diag = torch.eye(T, dtype=torch.bool, device=dev).expand(self.B, T, T)
            self._cache[("dense", j)] = torch.cat([prefix] + [diag] * j, dim=-1)[:, None]
        return self._cache[("dense", j)]

    def prefix_maps(self):
        """Block maps of the step-0 prefix (document-causal), as (partial, full) bool [B, n, n]."""
        if "prefix_maps" not in self._cache:
            T, bs, doc = self.T, self.block_size, self.doc_ids
            if T % bs:
                raise ValueError(f"flex TTT attention needs the row length ({T}) to be a multiple of "
                                 f"its block size {bs}; pad the batch (TTTModel does)")
            n = T // bs
            q = torch.arange(T, device=doc.device)
            allowed = (doc[:, :, None] == doc[:, None, :]) & (q[:, None] >= q[None, :])
            blocks = allowed.view(self.B, n, bs, n, bs)
            full = blocks.all(4).all(2)
            self._cache["prefix_maps"] = (blocks.any(4).any(2) & ~full, full)
        return self._cache["prefix_maps"]

    def block_maps(self):
        """Block-level maps of every step, as (partial, full) bool [S, B, 1, n, S*n] with n = T/bs.

        A block is full if every (query, key) pair in it may attend, partial if some may (the
        token-level mask_mod decides inside it), skipped otherwise. Step j lists the step-0 prefix
        blocks (from the doc ids) and one diagonal block per step 1..j.
        """
        if "maps" not in self._cache:
            T, bs, S, dev = self.T, self.block_size, self.num_steps, self.doc_ids.device
            partial0, full0 = self.prefix_maps()
            n = T // bs
            eye = torch.eye(n, dtype=torch.bool, device=dev)
            # diag[j, i] = step i's diagonal is visible at step j (1 <= i <= j)
            steps = torch.arange(S, device=dev)
            diag = (steps[None, :] >= 1) & (steps[None, :] <= steps[:, None])  # [S(j), S(i)]
            diag_maps = (diag[:, :, None, None] & eye).permute(0, 2, 1, 3).reshape(S, n, S * n)
            partial = torch.cat([partial0[None].expand(S, -1, -1, -1),
                                 diag_maps[:, None, :, n:].expand(-1, self.B, -1, -1)], dim=-1)
            full = torch.cat([full0, torch.zeros(self.B, n, (S - 1) * n, dtype=torch.bool, device=dev)], dim=-1)
            self._cache["maps"] = (partial[:, :, None], full[None, :, None].expand(S, -1, -1, -1, -1))
        return self._cache["maps"]

    def prefix_block(self):
        """flex BlockMask of the step-0 prefix alone ([T queries, T keys], document-causal): the
        ``flex`` backend's one mask for every step."""
        if "prefix" not in self._cache:
            from torch.nn.attention.flex_attention import BlockMask

            T, bs, doc = self.T, self.block_size, self.doc_ids
            partial, full = self.prefix_maps()
            kv_num, kv_idx = _ordered(partial[:, None])
            q_num, q_idx = _ordered(partial[:, None].transpose(-2, -1))
            fkv_num, fkv_idx = _ordered(full[:, None])
            fq_num, fq_idx = _ordered(full[:, None].transpose(-2, -1))
            self._cache["prefix"] = BlockMask(seq_lengths=(T, T), kv_num_blocks=kv_num, kv_indices=kv_idx,
                                              full_kv_num_blocks=fkv_num, full_kv_indices=fkv_idx,
                                              q_num_blocks=q_num, q_indices=q_idx, full_q_num_blocks=fq_num,
                                              full_q_indices=fq_idx, BLOCK_SIZE=(bs, bs),
                                              mask_mod=_prefix_mask_mod(doc))
        return self._cache["prefix"]

    def blocks(self) -> list:
        """flex BlockMasks of all steps over the fixed ``num_steps*T`` key layout.

        Built from the block maps of all steps at once (a dozen device ops in all, against
        hundreds per mask through ``create_block_mask``/``from_kv_blocks``: the host's launch
        overhead for those was a third of the step time). The token-level ``mask_mod`` is exact
        on its own (the unfused CPU path applies it everywhere) and reads j from a tensor, so one
        compiled kernel serves every step.
        """
        if "blocks" not in self._cache:
            from torch.nn.attention.flex_attention import BlockMask

            T, bs, S, doc = self.T, self.block_size, self.num_steps, self.doc_ids
            partial, full = self.block_maps()

            kv_num, kv_idx = _ordered(partial)
            q_num, q_idx = _ordered(partial.transpose(-2, -1))
            full_kv_num, full_kv_idx = _ordered(full[0])
            full_q_num, full_q_idx = _ordered(full[0].transpose(-2, -1))
            lasts = torch.arange(S, device=doc.device)
            masks = []
            for j in range(S):
                masks.append(BlockMask(seq_lengths=(T, S * T), kv_num_blocks=kv_num[j], kv_indices=kv_idx[j],
                                       full_kv_num_blocks=full_kv_num, full_kv_indices=full_kv_idx,
                                       q_num_blocks=q_num[j], q_indices=q_idx[j], full_q_num_blocks=full_q_num,
                                       full_q_indices=full_q_idx, BLOCK_SIZE=(bs, bs),
                                       mask_mod=_ttt_mask_mod(doc, T, lasts[j])))
            self._cache["blocks"] = masks
        return self._cache["blocks"]

    def block(self, j: int):
        return self.blocks()[j]


def _ordered(dense: torch.Tensor):
    """(num_blocks, indices) of a dense block map, as flex's own ``_dense_to_ordered``."""
    d = dense.to(torch.int32)
    return (d.sum(-1).to(torch.int32).contiguous(),
            torch.argsort(d, dim=-1, descending=True, stable=True).to(torch.int32).contiguous())


def _prefix_mask_mod(doc: torch.Tensor):
    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (doc[b, kv_idx] == doc[b, q_idx])
    return mask_mod


def _ttt_mask_mod(doc: torch.Tensor, T: int, last: torch.Tensor):
    """Token-level TTT mask for keys laid out as step*T + index; ``last`` = j as a 0-d tensor
    (a tensor, not a constant, so the compiled kernel is not rebuilt per step)."""
    def mask_mod(b, h, q_idx, kv_idx):
        step = kv_idx // T
        s = kv_idx % T
        prefix = (step == 0) & (s <= q_idx) & (doc[b, s] == doc[b, q_idx])
        return prefix | ((step > 0) & (step <= last) & (s == q_idx))
    return mask_mod


def ttt_attention(q: torch.Tensor, ks: List[torch.Tensor], vs: List[torch.Tensor], mask,
                  scale: Optional[float] = None) -> torch.Tensor:
    """Attention of step j = len(ks)-1. q [B,Hq,T,D], ks/vs: per step [B,Hkv,T,D]; ``mask`` is a
    dense bool mask (sdpa), the prefix BlockMask of :meth:`TTTMask.prefix_block` (flex) or step j's
    BlockMask over keys padded to num_steps*T (flex_stacked). -> [B,T,Hq*D]."""
    gqa = q.shape[1] != ks[0].shape[1]
    if not isinstance(mask, torch.Tensor) and mask.seq_lengths[1] == ks[0].shape[2]:
        return _prefix_plus_diagonals(q, ks, vs, mask, scale, gqa).transpose(1, 2).flatten(2)
    if isinstance(mask, torch.Tensor):
        k = torch.cat(list(ks), dim=2)
        v = torch.cat(list(vs), dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    else:
        pad = mask.shape[-1] // ks[0].shape[2] - len(ks)
        k = torch.cat(list(ks) + [torch.zeros_like(ks[0])] * pad, dim=2)
        v = torch.cat(list(vs) + [torch.zeros_like(vs[0])] * pad, dim=2)  # an MLA draft's v is narrower
        out = _flex_attention(q.device)(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2).flatten(2)


def _prefix_plus_diagonals(q, ks, vs, prefix_mask, scale, gqa) -> torch.Tensor:
    """flex over the step-0 prefix, then the diagonals of steps 1..j merged in. -> [B,Hq,T,D]."""
    from torch.nn.attention.flex_attention import AuxRequest

    scale = scale if scale is not None else q.shape[-1] ** -0.5
    out, aux = _flex_attention(q.device)(q, ks[0], vs[0], block_mask=prefix_mask, scale=scale, enable_gqa=gqa,
                                         return_aux=AuxRequest(lse=True))
    return merge_diagonals(q, out, aux.lse, ks[1:], vs[1:], scale)


def merge_diagonals(q, out, lse, kd: List[torch.Tensor], vd: List[torch.Tensor], scale: float) -> torch.Tensor:
    """Attention over (prefix keys + one diagonal key per step in ``kd``) from the prefix's own
    output ``out`` [B,Hq,T,D] and log-sum-exp ``lse`` [B,Hq,T] (natural log, of scale*q.k): one
    softmax over [lse, s_1..s_j] weighs the prefix's output against each diagonal value. Exact,
    differentiable through ``lse``; float32 inside, q's dtype out."""
    if not kd:
        return out
    B, Hq, T, D = q.shape
    Hkv = kd[0].shape[1]
    g = Hq // Hkv
    # elementwise products + reductions (fused by the compiler), not batched matmuls: the inner
    # dimensions (j, D) are far too small for a GEMM kernel to pay
    qg = q.view(1, B, Hkv, g, T, D).float()
    s = (qg * torch.stack(kd).unsqueeze(3).float()).sum(-1) * scale  # diagonal scores [j, B, Hkv, g, T]
    w = torch.softmax(torch.cat([lse.float().view(1, B, Hkv, g, T), s]), dim=0)
    Dv = out.shape[-1]  # the value width (an MLA draft's v_head_dim differs from q/k's)
    merged = w[0, ..., None] * out.float().view(B, Hkv, g, T, Dv) \
        + (w[1:, ..., None] * torch.stack(vd).unsqueeze(3).float()).sum(0)
    return merged.view(B, Hq, T, Dv).to(q.dtype)


def naive_ttt_attention(q, ks, vs, doc_ids, scale: Optional[float] = None) -> torch.Tensor:
    """Reference: each query's attention written out key by key (tests only; slow, float64)."""
    B, Hq, T, D = q.shape
    j = len(ks) - 1
    rep = Hq // ks[0].shape[1]
    scale = scale if scale is not None else D ** -0.5
    out = torch.zeros(B, T, Hq, vs[0].shape[-1], dtype=torch.float64, device=q.device)
    for b in range(B):
        for t in range(T):
            keys, vals = [], []
            for s in range(t + 1):
                if doc_ids[b, s] == doc_ids[b, t]:
                    keys.append(ks[0][b, :, s])
                    vals.append(vs[0][b, :, s])
            for i in range(1, j + 1):
                keys.append(ks[i][b, :, t])
                vals.append(vs[i][b, :, t])
            K = torch.stack(keys, 1).double().repeat_interleave(rep, 0)  # [Hq, n, D]
            V = torch.stack(vals, 1).double().repeat_interleave(rep, 0)
            w = torch.softmax((K @ q[b, :, t].double()[:, :, None]).squeeze(-1) * scale, dim=-1)
            out[b, t] = (w[:, :, None] * V).sum(1)
    return out.flatten(2)
