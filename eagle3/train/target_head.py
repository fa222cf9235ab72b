"""The frozen pieces of the target the draft trains against: embedding, final norm, lm_head.

The training targets are the target's next-token distribution over the draft vocabulary,
recomputed from the stored last (pre-norm) hidden state: the draft vocabulary's logits in one
matmul, then the other tokens' logits one chunk at a time (never the full-vocabulary logits at
once), each chunk only updating a running maximum, to mask the positions whose target token (the
full-vocabulary argmax) the draft cannot produce. That mask is the same for a sample every epoch:
:class:`InVocabCache` keeps it, and from the second epoch on only the draft vocabulary's rows are
multiplied (``train.target_cache``). ``model_inputs`` is this head's share of every
step: a collated batch turned into the TTT model's inputs (shared by the loop and bench/train.py).

Nothing here is trained, and nothing here is the draft's own head (eagle3.model.draft).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class TargetHead(nn.Module):
    """Holds frozen target tensors as buffers (never parameters: nothing here is trained).

    The lm_head is held with its rows reordered: the draft vocabulary's rows first (in draft
    order), then the other tokens' rows in increasing id order (``row_ids`` says which target id
    each row is). The draft-vocab logits are then one plain matmul, with no gather of kept
    columns out of full-vocab chunks, and the other rows only feed a running maximum.
    """

    def __init__(self, embed: torch.Tensor, norm_weight: torch.Tensor, lm_head: torch.Tensor,
                 rms_norm_eps: float, kept_ids: torch.Tensor, vocab_chunk: int = 32768,
                 row_chunk: int = 4096, compile: bool = False):
        super().__init__()
        if lm_head.shape != embed.shape:
            raise ValueError(f"target lm_head {tuple(lm_head.shape)} and embedding {tuple(embed.shape)} "
                             f"differ in shape; check the checkpoint's tensor names")
        kept_ids = kept_ids.long().to(lm_head.device)
        if not bool((kept_ids[1:] > kept_ids[:-1]).all()):
            raise ValueError("the draft vocabulary (d2t) must list target ids in increasing order")
        is_kept = torch.zeros(lm_head.shape[0], dtype=torch.bool, device=kept_ids.device)
        is_kept[kept_ids] = True
        row_ids = torch.cat([kept_ids, (~is_kept).nonzero().flatten()])
        self.register_buffer("embed_weight", embed, persistent=False)
        self.register_buffer("norm_weight", norm_weight, persistent=False)
        self.register_buffer("head_rows", lm_head[row_ids], persistent=False)
        self.register_buffer("row_ids", row_ids, persistent=False)
        self.register_buffer("kept_ids", kept_ids, persistent=False)
        self.eps = rms_norm_eps
        self.vocab_chunk = vocab_chunk
        self.row_chunk = row_chunk
        # compile=True: targets() runs as one compiled graph (the matmuls stay cuBLAS; norm,
        # softmax and the running maxima fused around them, some 30 launches fewer per batch)
        self.compile = compile
        self._compiled = None
        self.requires_grad_(False)

    @property
    def vocab_size(self) -> int:
        return self.head_rows.shape[0]

    @property
    def draft_vocab_size(self) -> int:
        return self.kept_ids.numel()

    def kept_lm_head(self) -> torch.Tensor:
        """The target's lm_head rows of the draft vocabulary (to initialise the draft's)."""
        return self.head_rows[: self.draft_vocab_size]

    @torch.no_grad()
    def embed(self, input_ids: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        e = F.embedding(input_ids, self.embed_weight)
        return e if dtype is None else e.to(dtype)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.head_rows.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(dtype) * self.norm_weight.to(dtype)

    def targets(self, last_hidden: torch.Tensor, out_dtype: torch.dtype = torch.float32,
                in_vocab: Optional[torch.Tensor] = None):
        """(probs [..., draft_vocab] in out_dtype, in_vocab [...] bool) for last hidden [..., H].

        probs = softmax of the target's logits restricted to the kept tokens; in_vocab says whether
        the target's argmax over the FULL vocabulary is a kept token (ties resolved as argmax over
        the full row does: the lowest target id among the maxima). ``in_vocab`` given (known from
        an earlier pass over the same states, :class:`InVocabCache`): returned as it is, and the
        other tokens' rows of the lm_head are not multiplied at all.
        """
        if self.compile:
            if self._compiled is None:
                self._compiled = torch.compile(self._targets, dynamic=False)
            return self._compiled(last_hidden, out_dtype, in_vocab)
        return self._targets(last_hidden, out_dtype, in_vocab)

    @torch.no_grad()
    def _targets(self, last_hidden: torch.Tensor, out_dtype: torch.dtype, known: Optional[torch.Tensor] = None):
        lead = last_hidden.shape[:-1]
        x = last_hidden.reshape(-1, last_hidden.shape[-1])
        N, V, Vd = x.shape[0], self.vocab_size, self.draft_vocab_size
        probs = torch.empty(N, Vd, dtype=out_dtype, device=x.device)
        in_vocab = torch.empty(N, dtype=torch.bool, device=x.device) if known is None else known.reshape(N)
        for r0 in range(0, N, self.row_chunk):
            h = self._norm(x[r0:r0 + self.row_chunk])
            n = h.shape[0]
            draft_logits = h @ self.head_rows[:Vd].T
            # compared in the matmul's dtype: widening to float32 is exact, so maxima and their
            # positions are the same without writing a float32 copy of any chunk
            kept_max, kept_arg = draft_logits.max(-1)
            # softmax accumulates in float32 whatever its output dtype (one pass, no float32 copy)
            probs[r0:r0 + n] = torch.softmax(draft_logits, dim=-1, dtype=None if out_dtype == draft_logits.dtype
                                              else torch.float32)
            if V == Vd:  # the draft vocabulary is the whole vocabulary
                in_vocab[r0:r0 + n] = True
                continue
            if known is not None:
                continue
            best = torch.full((n,), float("-inf"), device=x.device)
            best_row = torch.full((n,), Vd, dtype=torch.long, device=x.device)
            for c0 in range(Vd, V, self.vocab_chunk):
                cmax, carg = (h @ self.head_rows[c0:c0 + self.vocab_chunk].T).max(-1)
                cmax = cmax.float()
                # rows are in increasing id order here: strict '>' keeps the lowest id of a tie
                better = cmax > best
                best = torch.where(better, cmax, best)
                best_row = torch.where(better, carg + c0, best_row)
            kept_max = kept_max.float()
            in_vocab[r0:r0 + n] = (kept_max > best) | ((kept_max == best)
                                                        & (self.kept_ids[kept_arg] < self.row_ids[best_row]))
        return probs.reshape(*lead, Vd), in_vocab.reshape(lead)


class InVocabCache:
    """The target head's ``in_vocab`` bit of every token of the samples it has scored, on the device,
    so that a sample seen again (the next epoch) skips the lm_head's rows outside the draft
    vocabulary: at the 8B shape (32,000 of 128,256 rows) three quarters of the head's FLOPs. The bit
    depends only on the sample's stored last hidden state and the frozen lm_head, so it is the one
    the head would compute again (up to the GEMM's rounding on exact ties). One byte a token.

    Whether a batch is known is decided on the host (how many tokens of each sample are stored), so
    neither lookup nor store reads the device. Batches come from :func:`eagle3.train.data.collate`
    (``docs``: each row's (sample id, tokens) in order; ``doc_ids`` and ``position_ids`` place them)."""

    def __init__(self, lengths, max_len: int, device):
        lens = np.minimum(np.asarray(lengths, dtype=np.int64), max_len)
        self.offsets = torch.as_tensor(np.concatenate([[0], np.cumsum(lens)[:-1]]), device=device)
        self.bits = torch.zeros(int(lens.sum()) + 1, dtype=torch.bool, device=device)  # + a slot for padding
        self.known = np.zeros(len(lens), dtype=np.int64)
        self.hits = self.misses = 0

    @property
    def nbytes(self) -> int:
        return self.bits.numel()

    def _index(self, batch: dict) -> torch.Tensor:
        docs = batch["docs"]
        D = max(1, max(len(r) for r in docs))
        sample_of_doc = torch.tensor([[s for s, _ in r] + [0] * (D - len(r)) for r in docs],
                                     dtype=torch.long).to(self.bits.device, non_blocking=True)
        doc_ids = batch["doc_ids"]
        idx = self.offsets[sample_of_doc.gather(1, doc_ids.clamp(min=0))] + batch["position_ids"]
        return torch.where(doc_ids >= 0, idx, self.bits.numel() - 1)  # padding: the spare slot

    def lookup(self, batch: dict) -> Optional[torch.Tensor]:
        """The batch's in_vocab [B, T] if every token of it is stored; None otherwise."""
        if any(self.known[s] < n for row in batch["docs"] for s, n in row):
            self.misses += 1
            return None
        self.hits += 1
        return self.bits[self._index(batch)]

    def store(self, batch: dict, in_vocab: torch.Tensor) -> None:
        """Keep a batch's computed in_vocab (padding goes to the spare slot: no mask, no sync)."""
        self.bits.index_put_((self._index(batch),), in_vocab)
        for row in batch["docs"]:
            for s, n in row:
                self.known[s] = max(self.known[s], n)


def model_inputs(head: TargetHead, batch: dict, compute_dtype: torch.dtype,
                 cache: Optional[InVocabCache] = None) -> dict:
    """A collated batch (eagle3.train.data.collate) -> the keyword arguments of TTTModel's forward.

    The frozen target's share of a step, without gradients: the token embeddings and the
    draft-vocabulary targets. Target probabilities are kept in the compute dtype (bf16 under mixed
    precision: half the memory of float32; the loss upcasts them).

    A batch of an fp8 store (float8 states with ``aux_scales`` / ``last_scales``, see collate) is
    dequantised here, on the batch's device (eagle3.fp8.dequantize: float32, then the compute dtype
    for the aux states; the last state goes to the head in float32, which normalises in float32).
    ``cache``: in_vocab taken from it where the batch's samples were scored before, and stored in it
    where not (:class:`InVocabCache`)."""
    aux, last = batch["aux_hidden_states"], batch["last_hidden_state"]
    if "aux_scales" in batch:
        from ..fp8 import dequantize

        B, T, n = batch["aux_scales"].shape
        aux = dequantize(aux.view(B, T, n, -1), batch["aux_scales"], compute_dtype).view(B, T, -1)
        last = dequantize(last, batch["last_scales"])
    with torch.no_grad():
        embeds = head.embed(batch["input_ids"], compute_dtype)
        known = cache.lookup(batch) if cache is not None else None
        probs, in_vocab = head.targets(last, compute_dtype, known)
        if cache is not None and known is None:
            cache.store(batch, in_vocab)
    return dict(aux=aux.to(compute_dtype), embeds=embeds, target_probs=probs,
                in_vocab=in_vocab, loss_mask=batch["loss_mask"], position_ids=batch["position_ids"],
                doc_ids=batch["doc_ids"], head_rows=batch.get("head_rows"))
