"""Training metrics: how the draft does per TTT step (``step_metrics``: an
``eagle3.contracts.StepMetrics`` of loss, accuracy and expected acceptance length from the TTT
forward's summed statistics), model FLOPs and MFU, and the metrics.jsonl file they are written to."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from ..contracts import StepMetrics
from ..model.draft import Eagle3DraftConfig, count_matmul_params
from .ttt import STAT_NAMES

# bf16 dense tensor-core peak by device name (datasheet); used for the MFU estimate.
PEAK_BF16_FLOPS = {"H200": 989.5e12, "H100": 989.5e12, "A100": 312e12, "L40S": 362e12, "4090": 165e12}


def peak_flops(device_name: str) -> Optional[float]:
    for key, value in PEAK_BF16_FLOPS.items():
        if key in device_name:
            return value
    return None


def step_metrics(stats, decay: float) -> StepMetrics:
    """How the draft did over some positions (a log window, or an eval pass), per TTT step j, from
    the TTT forward's statistics [S, len(STAT_NAMES)] summed over those positions (all ranks).

    loss: the objective trained, sum_j decay**j * (CE summed at step j) / (loss positions of step j);
    loss_per_step / acc_per_step: mean CE and top-1 agreement over step j's scored positions (NaN
    where none); cond_acc_per_step: the same where steps 0..j-1 were all right (0 where none);
    accept_len: expected tokens per target step for chains of k = 1..S drafts."""
    rows = [dict(zip(STAT_NAMES, map(float, r))) for r in stats.cpu().tolist()]
    loss = sum(decay ** j * r["ce_sum"] / max(r["counted"], 1.0) for j, r in enumerate(rows))
    cond_acc = [r["cond_correct"] / r["cond_total"] if r["cond_total"] else 0.0 for r in rows]
    return StepMetrics(loss=loss,
                       loss_per_step=[r["ce_sum"] / r["scored"] if r["scored"] else float("nan") for r in rows],
                       acc_per_step=[r["correct"] / r["scored"] if r["scored"] else float("nan") for r in rows],
                       cond_acc_per_step=cond_acc, accept_len=expected_acceptance_lengths(cond_acc),
                       scored_positions=rows[0]["scored"])


def expected_acceptance_lengths(cond_acc) -> list:
    """E[tokens per target step] for chains of k=1..len drafts: 1 + sum_m prod_{j<m} cond_acc[j]
    (the target's own token is always gained; draft m is accepted only if drafts 0..m-1 were)."""
    out, run, total = [], 1.0, 1.0
    for a in cond_acc:
        a = 0.0 if a != a else a  # NaN (no positions) counts as never accepted
        run *= a
        total += run
        out.append(total)
    return out


def ttt_flops_per_token(cfg: Eagle3DraftConfig, seq_len: int, num_steps: int, target_vocab: int) -> float:
    """Model FLOPs of one training token: forward + backward of fc, the layer and lm_head at
    every TTT step, attention (causal prefix + diagonals), and the target head's full-vocab
    forward that makes the targets. Matmuls only (2 FLOPs per multiply-add).

    A nominal count, as MFU is usually reported: the layer at every step in full, although the
    training-time test computes the embeddings' part of q/k/v once per row rather than per step
    (:meth:`eagle3.model.draft.Eagle3MidLayer.project_embeds`) and no gradient of the embeddings."""
    p = count_matmul_params(cfg)
    flops = 4 * p["fc"]  # forward + weight gradient (its input needs no gradient)
    flops += 6 * (p["layer"] + p["lm_head"]) * num_steps
    qd = cfg.num_attention_heads * cfg.head_dim
    for j in range(num_steps):
        keys = (seq_len + 1) / 2 + j  # mean keys per query: causal prefix + j diagonals
        flops += 3.5 * 4 * qd * keys  # QK^T and PV forward, backward ~2.5x forward
    flops += 2 * target_vocab * cfg.hidden_size
    return flops


class JsonlLogger:
    """Append-only JSONL metrics file (one object per logged step), flushed per line; :meth:`sync`
    puts it on disk (the loop calls it before each checkpoint and at the end)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")

    def sync(self) -> None:
        if self.path.exists():
            with open(self.path, "a") as f:
                os.fsync(f.fileno())

    def truncate_after(self, step: int) -> None:
        """Drop lines logged after ``step`` (a resumed run re-logs them)."""
        if not self.path.exists():
            return
        keep = [ln for ln in self.path.read_text().splitlines()
                if ln.strip() and json.loads(ln).get("step", 0) <= step]
        self.path.write_text("".join(ln + "\n" for ln in keep))
