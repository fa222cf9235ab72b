"""Training-time test: the draft unrolled over ``num_steps`` of its own predictions.

Indexing (one row of T tokens x_0..x_{T-1}; p_t = target's distribution of x_{t+1}):
- step 0 at index t: hidden = fc(aux_t), input token x_{t+1}, position t (as vLLM's first pass);
- step j at index t: hidden = step j-1's pre-norm output at t (its normed form with
  ``norm_output``), input token x_{t+j+1}, position t+j;
- its target is p_{t+j+1} (the token x_{t+j+2}); it is scored where x_{t+j+2} is a loss token of
  the same document and the target's full-vocab argmax at t+j+1 is in the draft vocabulary.
Loss = sum_j decay**j * (sum of scored CE at step j) / denominators[j], where the caller passes
the number of loss positions of step j in the whole global batch (all ranks, all accumulation
micro-batches), so any split of a global batch over processes optimises the same objective.

The layer runs at every position (later positions attend to all of them); the draft head (lm_head)
and the loss, which only the loss positions need, run on those rows alone when the batch brings
them (:func:`head_rows`, ``train.loss_rows_only``).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from ..kernels.fp8_matmul import linear, quantize_weight
from ..kernels.head_loss import resolve as resolve_head_loss
from ..model.draft import Eagle3Draft
from .attention import TTTMask, resolve_backend, ttt_attention
from .loss import soft_cross_entropy_rows

# per-step statistics returned by the forward (summed over rows; reduce across ranks by sum)
STAT_NAMES = ("ce_sum", "scored", "counted", "correct", "cond_correct", "cond_total")


FLEX_BLOCK = 128


def _pad_right(x: torch.Tensor, n: int, fill) -> torch.Tensor:
    return torch.cat([x, x.new_full((x.shape[0], n) + tuple(x.shape[2:]), fill)], dim=1)


def shift_left(x: torch.Tensor, k: int, fill=0) -> torch.Tensor:
    """x[:, t+k] at index t, ``fill`` past the end (dim 1)."""
    if k == 0:
        return x
    pad = x.new_full((x.shape[0], k) + tuple(x.shape[2:]), fill)
    return torch.cat([x[:, k:], pad], dim=1)[:, : x.shape[1]]


def step_masks(loss_mask: torch.Tensor, doc_ids: torch.Tensor, in_vocab: torch.Tensor, num_steps: int):
    """(counted [S,B,T], scored [S,B,T]) booleans: loss positions of each step, and those of them
    whose target token the draft vocabulary contains."""
    counted, scored = [], []
    lm = loss_mask.bool()
    for j in range(num_steps):
        c = shift_left(lm, j + 2, False) & (shift_left(doc_ids, j + 2, -2) == doc_ids)
        counted.append(c)
        scored.append(c & shift_left(in_vocab, j + 1, False))
    return torch.stack(counted), torch.stack(scored)


HEAD_ROWS_MULTIPLE = 64


def head_rows(loss_mask: torch.Tensor, doc_ids: torch.Tensor, num_steps: int,
              multiple: int = HEAD_ROWS_MULTIPLE) -> Optional[torch.Tensor]:
    """The rows of the draft head's input [S, B, T], flattened, that the loss and the statistics
    read: every step's loss positions (``counted``; the scored ones are among them). Computed
    where the batch is collated, on the host, so that the forward needs no device sync to gather
    them. Padded to a multiple of ``multiple`` with a row that is no loss position (every step has
    one: its last index), which adds nothing to the loss, its gradient or the statistics. int64 [N].

    None where that leaves no row out (a batch whose every position has loss): the head then runs
    on every position, with nothing to gather. A run whose batches are of both kinds compiles the
    forward once for each."""
    lm = loss_mask.bool() & (doc_ids >= 0)
    counted, _ = step_masks(lm, doc_ids, torch.ones_like(lm), num_steps)
    flat = counted.flatten()
    rows = flat.nonzero().squeeze(1)
    n = max(multiple, -(-rows.numel() // multiple) * multiple)
    if n >= flat.numel():
        return None
    spare = int((~flat).nonzero()[0, 0])
    return torch.cat([rows, rows.new_full((n - rows.numel(),), spare)])


def remap_rows(rows: torch.Tensor, B: int, T: int, T_new: int) -> torch.Tensor:
    """Flat [S, B, T] row indices as indices of [S, B, T_new] (T_new >= T: the rows padded on the right)."""
    j, rem = rows // (B * T), rows % (B * T)
    return (j * B + rem // T) * T_new + rem % T


def check_fp8(recipe: str, device: torch.device, dtype: torch.dtype) -> None:
    """``train.fp8_matmul`` where it can run: a CPU, or a GPU of compute capability 9.0 or later
    (Hopper, Blackwell: torch's rowwise-scaled float8 matmul is built for them; Ada's 8.9 has float8
    tensor cores but that kernel was not, and is not tried here) computing in bf16 (the output dtype
    measured there)."""
    if recipe != "off" and device.type == "cuda" and torch.cuda.get_device_capability(device) < (9, 0):
        name = torch.cuda.get_device_name(device)
        raise ValueError(f"train.fp8_matmul={recipe} needs rowwise-scaled float8 matmuls, which torch runs on "
                         f"compute capability 9.0 or later (Hopper, Blackwell), not on {name} (compute capability "
                         f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}); use train.fp8_matmul=off")
    if recipe != "off" and device.type == "cuda" and dtype != torch.bfloat16:
        raise ValueError(f"train.fp8_matmul={recipe} on a GPU needs bf16 activations (train.mixed_precision=auto "
                         f"or bf16), not {dtype}; or use train.fp8_matmul=off")


def loss_denominators(loss_mask: torch.Tensor, doc_ids: torch.Tensor, num_steps: int) -> torch.Tensor:
    """Loss positions per step [S] (float) of a batch, from its raw fields only."""
    dummy = torch.ones_like(loss_mask, dtype=torch.bool)
    counted, _ = step_masks(loss_mask, doc_ids, dummy, num_steps)
    return counted.flatten(1).sum(1).float()


class TTTModel(nn.Module):
    """What Accelerate wraps: the draft plus the unrolled TTT forward that returns the loss.

    ``compile=True`` compiles the whole unrolled forward (weight casts, all steps, attention,
    loss and statistics) as one graph: per-op launch overhead on the host was what kept the
    GPU idle between steps, not the arithmetic. ``compile="cudagraphs"`` also replays the
    compiled forward and backward as CUDA graphs (bench/train.py only: one GPU, no DDP hooks;
    measured 1% faster there but half as fast inside the Accelerate loop, so the loop does not use it).
    """

    def __init__(self, draft: Eagle3Draft, num_steps: int = 7, decay: float = 0.8,
                 attention: str = "auto", compile: bool = False, head_loss: str = "auto", fp8_matmul: str = "off"):
        super().__init__()
        self.draft = draft
        self.num_steps = num_steps
        self.decay = decay
        self.attention = attention
        self.compile = compile
        self.head_loss = head_loss
        self.fp8_matmul = fp8_matmul  # train.fp8_matmul: the layer's and fc's matmuls (eagle3.kernels.fp8_matmul)
        self._head_loss = None  # resolved on the inputs' device
        self._compiled_core = None

    def forward(self, aux: torch.Tensor, embeds: torch.Tensor, target_probs: torch.Tensor,
                in_vocab: torch.Tensor, loss_mask: torch.Tensor, position_ids: torch.Tensor,
                doc_ids: torch.Tensor, denominators: Optional[torch.Tensor] = None,
                head_rows: Optional[torch.Tensor] = None):
        """aux [B,T,n_aux*H]; embeds [B,T,H] of x_0..x_{T-1} (their dtype is the compute dtype);
        target_probs [B,T,V_draft] = p_t; in_vocab, loss_mask, position_ids, doc_ids [B,T].
        ``head_rows``: :func:`head_rows` of the batch, on its device; then the draft head and the
        loss run on those rows only (what the loss and statistics read), else on every position.
        Returns (loss, stats [S, len(STAT_NAMES)] float64 sums)."""
        S, T = self.num_steps, loss_mask.shape[1]
        T_in, B = T, loss_mask.shape[0]
        loss_mask = loss_mask * (doc_ids >= 0)  # negative doc ids mark padding
        backend = resolve_backend(self.attention, embeds.device)
        self._head_loss = resolve_head_loss(self.head_loss, embeds.device)
        check_fp8(self.fp8_matmul, embeds.device, embeds.dtype)
        if backend.startswith("flex") and embeds.device.type == "cpu" and torch.is_grad_enabled():
            raise ValueError(f"train.attention={backend} cannot train on CPU (torch's flex_attention has no CPU "
                             "backward); use train.attention=auto or sdpa there")
        if backend.startswith("flex") and T % FLEX_BLOCK:
            # flex's block map needs whole blocks: pad on the right with a padding document
            # (no loss positions), which changes nothing for the real positions
            extra = FLEX_BLOCK - T % FLEX_BLOCK
            aux, embeds, target_probs = (_pad_right(x, extra, 0) for x in (aux, embeds, target_probs))
            in_vocab, loss_mask, position_ids = (_pad_right(x, extra, 0) for x in (in_vocab, loss_mask, position_ids))
            doc_ids = _pad_right(doc_ids, extra, int(doc_ids.min()) - 1)
            T = T + extra
            if head_rows is not None:
                head_rows = remap_rows(head_rows, B, T_in, T)
        with torch.no_grad():
            mask = TTTMask(doc_ids, S, backend, block_size=FLEX_BLOCK)
            if backend == "flex":
                masks = [mask.prefix_block()] * S
            elif backend == "flex_stacked":
                masks = mask.blocks()
            else:
                masks = [mask.dense(j) for j in range(S)]
        core = self._core
        if self.compile:
            if self._compiled_core is None:
                mode = "reduce-overhead" if self.compile == "cudagraphs" else None
                self._compiled_core = torch.compile(self._core, dynamic=False, mode=mode)
            core = self._compiled_core
            if self.compile == "cudagraphs":
                torch.compiler.cudagraph_mark_step_begin()
            if head_rows is not None:  # its length changes from batch to batch: one graph for all
                torch._dynamo.mark_dynamic(head_rows, 0)
        return core(aux, embeds, target_probs, in_vocab, loss_mask, position_ids, doc_ids, denominators, masks,
                    head_rows)

    def _core(self, aux, embeds, target_probs, in_vocab, loss_mask, position_ids, doc_ids, denominators, masks,
              head_rows=None):
        S, (B, T) = self.num_steps, loss_mask.shape
        dtype = embeds.dtype
        draft, layer = self.draft, self.draft.midlayer
        with torch.no_grad():
            counted, scored = step_masks(loss_mask, doc_ids, in_vocab, S)
            if denominators is None:
                denominators = counted.flatten(1).sum(1).float()
            denominators = denominators.clamp(min=1.0)
            # one padded copy of the shifted inputs; each step reads a view (same shape every step)
            pad = S + 1
            embeds_pad = torch.cat([embeds, embeds.new_zeros(B, pad, embeds.shape[-1])], dim=1)
            target_pad = torch.cat([target_probs, target_probs.new_zeros(B, pad, target_probs.shape[-1])], dim=1)
            target_arg = target_pad.argmax(-1)
        # weights cast to the compute dtype once per forward (not once per step), q/k/v and
        # gate/up packed into single matmuls; gradients flow back to the fp32 parameters
        # train.fp8_matmul: the training's matmuls only; evaluation (no gradients) multiplies in bf16,
        # as the draft is served
        fp8 = self.fp8_matmul if torch.is_grad_enabled() else "off"
        wl = layer.weights(dtype, fp8=fp8)
        norm_w, lm_head_w = draft.norm.weight.to(dtype), draft.lm_head.weight.to(dtype)
        # fc_input: the EAGLE-3.1 norms of the aux states (norm_before_fc, fc_norm), if set
        h = linear(draft.fc_input(aux), quantize_weight(draft.fc.weight.to(dtype), fp8))
        # the embeddings' part of q/k/v once for the row (tokens x_1 .. x_{T+S-1} and padding); step j
        # reads the window of tokens x_{j+1} .. x_{j+T}: one matmul, and one weight gradient, instead
        # of S over shifted copies of the same rows
        pe = layer.project_embeds(embeds_pad[:, 1: T + S], wl)
        ks, vs = [], []
        outs = []
        for j in range(S):
            cos, sin = draft.rope(position_ids + j, dtype)
            q, k, v, residual = layer.pre_attention(h, pe[:, j: j + T], cos, sin, wl, projected=True)
            ks.append(k)
            vs.append(v)
            out = layer.post_attention(ttt_attention(q, ks, vs, masks[j], scale=draft.attn_scale), residual, wl)
            outs.append(out)
            h = draft.feedback(out, norm_w)  # norm_output: the next step gets norm(out), as in vLLM
        # The draft head of all steps at once: no step needs another's logits (step j+1 is fed the
        # pre-norm output), so the lm_head runs as one matmul over S*B*T rows, and its weight
        # gradient as one matmul too, instead of S matmuls whose S outputs are then summed.
        acc = torch.promote_types(dtype, torch.float32)
        coef = (self.decay ** torch.arange(S, device=aux.device, dtype=acc)) / denominators.to(acc)
        fused = self._head_loss == "fused"
        if head_rows is None and not fused:
            logits = draft.logits(torch.stack(outs), norm_w, lm_head_w)  # [S, B, T, Vd]
            # step j's targets are rows j+1 .. j+T of the padded targets: windows of one view, not a copy
            target = target_pad.unfold(1, T, 1)[:, 1:S + 1].permute(1, 0, 3, 2)  # [S, B, T, Vd]
            # per-row cross-entropy once, for the loss and (detached) for the statistics: one pass of
            # reductions (logsumexp, <p, logits> and the argmax) over all steps' logits
            ce = soft_cross_entropy_rows(logits, target)  # [S, B, T]
            with torch.no_grad():
                correct = logits.detach().argmax(-1) == target_arg.unfold(1, T, 1)[:, 1:S + 1].transpose(0, 1)
        else:
            # the head on rows of [S * B * T]: with head_rows only those the loss and the statistics
            # read (a batch's loss positions: the head's matmuls, the loss and their gradients shrink
            # with them; the results go back to their places in [S, B, T], zeros elsewhere, which
            # nothing reads: scored is a subset of counted), else all of them
            rows = torch.arange(S * B * T, device=aux.device) if head_rows is None else head_rows
            x = torch.stack(outs).flatten(0, 2)
            x = x if head_rows is None else x[head_rows]
            j, rem = rows // (B * T), rows % (B * T)
            tgt = (rem // T) * (T + pad) + rem % T + j + 1  # the row's target: p_{t+j+1} of its batch row
            if fused:  # the head, the loss, the argmax and the logits' gradient in one op (head_loss.py)
                weights = (scored.to(acc) * coef[:, None, None]).flatten()[rows]
                loss, ce_rows, arg, _ = torch.ops.eagle3.head_soft_ce(
                    draft.head_input(x, norm_w), lm_head_w, target_pad.flatten(0, 1), tgt, weights)
            else:
                logits = draft.logits(x, norm_w, lm_head_w)  # [N, Vd]
                ce_rows = soft_cross_entropy_rows(logits, target_pad.flatten(0, 1)[tgt])
                arg = logits.detach().argmax(-1)
            with torch.no_grad():
                hit = arg == target_arg.flatten()[tgt]
            if head_rows is None:
                ce, correct = ce_rows.view(S, B, T), hit.view(S, B, T)
            else:
                ce = ce_rows.new_zeros(S * B * T).index_put((head_rows,), ce_rows).view(S, B, T)
                correct = hit.new_zeros(S * B * T).index_put((head_rows,), hit).view(S, B, T)
        if not fused:
            loss = (ce * (scored.to(acc) * coef[:, None, None])).sum()
        with torch.no_grad():
            ok = scored & correct
            # chain[j]: steps 0..j-1 all scored and correct (what conditional accuracy is given)
            chain = torch.cat([torch.ones_like(ok[:1]), ok[:-1].int().cumprod(0).bool()])
            cond = chain & scored

            def per_step(x):
                return x.double().sum((1, 2))
            stats = torch.stack([per_step(ce.detach() * scored), per_step(scored), per_step(counted), per_step(ok),
                                 per_step(cond & correct), per_step(cond)], dim=1)
        return loss, stats
