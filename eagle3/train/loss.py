"""Soft cross-entropy of the draft's logits against the target's distribution."""
from __future__ import annotations

import torch


def soft_cross_entropy_rows(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per row: -sum_v target_v * log_softmax(logits)_v, in float32 (float64 stays float64).

    Written as logsumexp * sum(target) - <target, logits> so that a target stored in bf16 (whose
    probabilities sum to 1 only up to rounding) still gives the exact cross-entropy of that
    target; torch.compile fuses it into one pass that keeps only the bf16 logits for backward.
    """
    acc = torch.promote_types(logits.dtype, torch.float32)  # float32 at least (float64 stays)
    x = logits.to(acc)
    p = target.to(acc)
    return torch.logsumexp(x, dim=-1) * p.sum(-1) - (p * x).sum(-1)

