"""The optimizer side of the train loop: fused AdamW, its learning-rate schedule (linear warmup,
then cosine decay), and gradient-norm clipping folded into the fused AdamW kernel.

Clipping: ``torch.nn.utils.clip_grad_norm_`` reads every gradient once for the norm and then
rewrites every gradient (a read and a write of 4 bytes per parameter) to scale it, before AdamW
reads them a third time. The fused AdamW kernel already divides each gradient by an optional
``grad_scale`` tensor (the hook ``torch.amp.GradScaler`` uses), so the clip coefficient is
handed to it instead: the same update (g * c == g / (1/c) up to rounding), one pass over the
gradients less. The norm is computed as torch's clip does, on the device, without a host sync.
"""
from __future__ import annotations

import math

import torch

EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_


def adamw(params, tcfg, device: torch.device) -> torch.optim.AdamW:
    """AdamW, fused (one kernel over all parameters, and what :func:`fold_clip` hands the clip to)."""
    return torch.optim.AdamW(params, lr=tcfg.lr, betas=tuple(tcfg.betas), weight_decay=tcfg.weight_decay,
                             fused=device.type in ("cuda", "cpu"))


def lr_lambda(warmup: int, total: int, min_ratio: float):
    """Step -> factor of the peak rate: linear warmup over ``warmup`` steps, then cosine decay to
    ``min_ratio`` at step ``total``."""
    def f(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


def lr_schedule(optimizer, tcfg, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The schedule of ``total`` optimizer steps. The caller steps it once per optimizer step, by hand:
    Accelerate's prepared scheduler steps once per process, so with N processes it would run N
    times faster."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(tcfg.warmup_steps, total, tcfg.min_lr_ratio))


def can_fold(optimizer) -> bool:
    """Whether ``optimizer`` applies ``grad_scale`` itself: torch's fused Adam/AdamW."""
    return isinstance(optimizer, torch.optim.Adam) and bool(optimizer.defaults.get("fused"))


def fold_clip(optimizer, params, max_norm: float) -> torch.Tensor:
    """Total 2-norm of the gradients; sets ``optimizer.grad_scale`` so that its next step uses the
    gradients clipped to ``max_norm`` (``optimizer`` must satisfy :func:`can_fold`)."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, 2.0, foreach=True)
    # clip_grad_norm_ multiplies by min(max_norm / (norm + eps), 1); the kernel divides by its inverse
    optimizer.grad_scale = torch.clamp((norm.float() + EPS) / max_norm, min=1.0)
    return norm


def clip_gradients(accelerator, model, optimizer, max_norm: float) -> torch.Tensor:
    """Clip before ``optimizer.step()``; returns the total norm. Folded into fused AdamW on one
    process or DDP (gradients whole on every rank, no loss scaler); Accelerate's own clipping
    elsewhere (FSDP shards need its sharded norm, fp16 its scaler, which sets grad_scale itself)."""
    from accelerate.utils import DistributedType

    inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's AcceleratedOptimizer wraps it
    if (can_fold(inner) and accelerator.scaler is None
            and accelerator.distributed_type in (DistributedType.NO, DistributedType.MULTI_GPU)):
        return fold_clip(inner, model.parameters(), max_norm)
    norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a DTensor
