"""The frozen pieces of the target the draft trains against: embedding, final norm, lm_head.

The training targets are the target's next-token distribution over the draft vocabulary,
recomputed from the stored last (pre-norm) hidden state. The full-vocabulary logits are only
ever held one chunk at a time: each chunk updates the running full-vocab argmax (to mask
positions whose target token the draft cannot produce) and hands over its kept columns.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


class TargetHead(nn.Module):
    """Holds frozen target tensors as buffers (never parameters: nothing here is trained)."""

    def __init__(self, embed: torch.Tensor, norm_weight: torch.Tensor, lm_head: torch.Tensor,
                 rms_norm_eps: float, kept_ids: torch.Tensor, vocab_chunk: int = 32768,
                 row_chunk: int = 4096):
        super().__init__()
        if lm_head.shape != embed.shape:
            raise ValueError(f"target lm_head {tuple(lm_head.shape)} and embedding {tuple(embed.shape)} "
                             f"differ in shape; check the checkpoint's tensor names")
        kept_ids = kept_ids.long()
        if not bool((kept_ids[1:] > kept_ids[:-1]).all()):
            raise ValueError("the draft vocabulary (d2t) must list target ids in increasing order")
        self.register_buffer("embed_weight", embed, persistent=False)
        self.register_buffer("norm_weight", norm_weight, persistent=False)
        self.register_buffer("lm_head_weight", lm_head, persistent=False)
        self.register_buffer("kept_ids", kept_ids, persistent=False)
        is_kept = torch.zeros(lm_head.shape[0], dtype=torch.bool, device=kept_ids.device)
        is_kept[kept_ids] = True  # once here: per step, `t[idx] = True` on a GPU tensor syncs the host
        self.register_buffer("is_kept", is_kept, persistent=False)
        self.eps = rms_norm_eps
        self.vocab_chunk = vocab_chunk
        self.row_chunk = row_chunk
        self.requires_grad_(False)

    @property
    def vocab_size(self) -> int:
        return self.lm_head_weight.shape[0]

    @property
    def draft_vocab_size(self) -> int:
        return self.kept_ids.numel()

    def kept_lm_head(self) -> torch.Tensor:
        """The target's lm_head rows of the draft vocabulary (to initialise the draft's)."""
        return self.lm_head_weight[self.kept_ids]

    def _chunk_bounds(self) -> list:
        """Where each vocab chunk's kept ids start in ``kept_ids`` (sorted ids: one slice per
        chunk). Computed once: reading it back from the device each step would stall the GPU."""
        if getattr(self, "_bounds", None) is None:
            V, c = self.vocab_size, self.vocab_chunk
            edges = torch.arange(0, V + c, c, device=self.kept_ids.device).clamp(max=V)
            self._bounds = torch.searchsorted(self.kept_ids, edges).tolist()
        return self._bounds

    @torch.no_grad()
    def embed(self, input_ids: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        e = F.embedding(input_ids, self.embed_weight)
        return e if dtype is None else e.to(dtype)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.lm_head_weight.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(dtype) * self.norm_weight.to(dtype)

    @torch.no_grad()
    def targets(self, last_hidden: torch.Tensor, out_dtype: torch.dtype = torch.float32):
        """(probs [..., draft_vocab] in out_dtype, in_vocab [...] bool) for last hidden [..., H].

        probs = softmax of the target's logits restricted to the kept tokens; in_vocab says whether
        the target's argmax over the FULL vocabulary is a kept token.
        """
        lead = last_hidden.shape[:-1]
        x = last_hidden.reshape(-1, last_hidden.shape[-1])
        N, V, Vd = x.shape[0], self.vocab_size, self.draft_vocab_size
        probs = torch.empty(N, Vd, dtype=out_dtype, device=x.device)
        in_vocab = torch.empty(N, dtype=torch.bool, device=x.device)
        kept, bounds = self.kept_ids, self._chunk_bounds()
        for r0 in range(0, N, self.row_chunk):
            h = self._norm(x[r0:r0 + self.row_chunk])
            n = h.shape[0]
            best = torch.full((n,), float("-inf"), device=x.device)
            best_kept = torch.zeros(n, dtype=torch.bool, device=x.device)
            draft_logits = torch.empty(n, Vd, dtype=torch.float32, device=x.device)
            for ci, c0 in enumerate(range(0, V, self.vocab_chunk)):
                c1 = min(c0 + self.vocab_chunk, V)
                # compared in the matmul's dtype: widening to float32 is exact, so the max and
                # its position are the same without writing a float32 copy of the chunk
                logits = h @ self.lm_head_weight[c0:c1].T
                k0, k1 = bounds[ci], bounds[ci + 1]
                local = kept[k0:k1] - c0
                draft_logits[:, k0:k1] = logits[:, local]
                cmax, carg = logits.max(-1)
                cmax = cmax.float()
                # strict '>' keeps the first maximum, as argmax over the full row would
                better = cmax > best
                best = torch.where(better, cmax, best)
                best_kept = torch.where(better, self.is_kept[c0:c1][carg], best_kept)
            probs[r0:r0 + n] = torch.softmax(draft_logits, dim=-1).to(out_dtype)
            in_vocab[r0:r0 + n] = best_kept
        return probs.reshape(*lead, Vd), in_vocab.reshape(lead)


def target_head_from_tensors(tensors: dict, rms_norm_eps: float, kept_ids: torch.Tensor,
                             device=None, dtype: Optional[torch.dtype] = None) -> TargetHead:
    """A TargetHead from {'embed', 'norm', 'lm_head'} tensors (see eagle3.target_weights)."""
    def prep(t):
        t = t.to(device) if device is not None else t
        return t.to(dtype) if dtype is not None else t
    return TargetHead(prep(tensors["embed"]), prep(tensors["norm"]), prep(tensors["lm_head"]),
                      rms_norm_eps, kept_ids.to(device) if device is not None else kept_ids)
