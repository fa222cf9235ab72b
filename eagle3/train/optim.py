"""The optimizer side of the train loop: AdamW (or Muon + AdamW, ``train.optimizer=muon``),
the learning-rate schedule (linear warmup, then cosine decay), and gradient-norm clipping folded
into the AdamW kernel.

AdamW is torch's fused AdamW or :class:`CompiledAdamW` (``train.adamw_impl``; ``auto``: compiled on
CUDA), the same update and state computed by one compiled kernel per parameter, which moves the
parameters, gradients and moments at a higher rate than the fused kernel's ``multi_tensor_apply``
(bench/results/compiled_adamw_h200_202612.md).

Muon orthogonalises each 2-D weight's momentum (Newton-Schulz); it takes only 2-D parameters.
``train.muon_impl``: fast (:class:`eagle3.kernels.muon.FastMuon`: torch's update, a Gram-form
Newton-Schulz on wide matrices, same-shape matrices batched) or torch (``torch.optim.Muon``); both
keep the same state, so a checkpoint of one resumes with the other. :func:`split_for_muon` gives
it the 2-D weights of the hidden path and leaves lm_head (an output head, as speculators and Keller
Jordan's Muon leave it) and the norms to AdamW.
:class:`MuonWithAdamW` is the two as one ``torch.optim.Optimizer`` (the same group dicts, one state),
so the loop, Accelerate's prepare/save_state/load_state and the LR schedule see one optimizer.
Muon's update is per parameter, on the whole matrix: with DDP every rank holds the whole all-reduced
gradient, so the update is the same on every rank; FastMuon splits its Newton-Schulz work over the
ranks and shares the results in one all-reduce (``train.muon_shard``), torch's Muon computes all of it on each.
FSDP shards are refused (:func:`check_optimizer_distribution`).

Clipping: ``torch.nn.utils.clip_grad_norm_`` reads every gradient once for the norm and then
rewrites every gradient (a read and a write of 4 bytes per parameter) to scale it, before AdamW
reads them a third time. The fused AdamW kernel already divides each gradient by an optional
``grad_scale`` tensor (the hook ``torch.amp.GradScaler`` uses), so the clip coefficient is
handed to it instead: the same update (g * c == g / (1/c) up to rounding), one pass over the
gradients less. The norm is computed as torch's clip does, on the device, without a host sync.
With ``train.optimizer=muon`` and FastMuon the same coefficient goes to both halves: fused AdamW
divides its gradients by it, FastMuon in the pass that updates the momentum.
"""
from __future__ import annotations

import math

import torch

from ..kernels.muon import FastMuon, closure_loss

EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_


def adamw_pass(params: list, grads: list, exp_avgs: list, exp_avg_sqs: list, steps: list, lr: torch.Tensor,
               beta1: float, beta2: float, weight_decay: float, eps: float, grad_scale) -> None:
    """torch's AdamW update (``torch.optim.AdamW``, no amsgrad, no maximize), in place, in the order
    and arithmetic of its fused kernel: the gradient divided by ``grad_scale`` (a tensor, or None),
    decoupled decay, both moments, then the bias-corrected step. ``steps`` are the parameters'
    float32 step counters on the device (fused AdamW's), ``lr`` a 0-dim float64 tensor on the host,
    so that neither a new rate nor a new step count changes the compiled graph."""
    for p, g, m, v, step in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
        step += 1
        if grad_scale is not None:
            g = g / grad_scale
        p.mul_(1 - lr * weight_decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        step_size = lr / (1 - beta1 ** step)
        denom = v.sqrt() / (1 - beta2 ** step).sqrt() + eps
        p.sub_(step_size * m / denom)


class CompiledAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` whose step is :func:`adamw_pass` compiled by ``torch.compile``
    (``train.adamw_impl=compiled``): one generated kernel per parameter that reads the parameter,
    its gradient and both moments once and writes the three back, where torch's fused kernel runs
    the same update through ``multi_tensor_apply``. The same arguments, param groups and state
    (``step`` a float32 tensor on the parameter's device, ``exp_avg``, ``exp_avg_sq``) as fused
    AdamW, so a checkpoint of either loads into the other; it takes ``grad_scale`` (the clip's
    coefficient, :func:`fold_clip`) as fused AdamW does. ``compile=False`` runs the pass eagerly
    (what the CPU tests compare with fused AdamW)."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 compile: bool = True):
        # fused=True: the param groups say what fused AdamW's say, so that a checkpoint of this class
        # loads into fused AdamW as one of its own, and torch keeps a loaded checkpoint's step counters
        # on the device as float32, as both hold them. torch's own (fused) step is never called.
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True)
        self.grad_scale = None
        self._pass = torch.compile(adamw_pass, dynamic=False) if compile else adamw_pass

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        if getattr(self, "found_inf", None) is not None:
            raise ValueError("CompiledAdamW does not skip steps on found_inf (an fp16 loss scaler): use "
                             "train.adamw_impl=fused")
        for group in self.param_groups:
            if group.get("amsgrad") or group.get("maximize"):
                raise ValueError("CompiledAdamW implements AdamW without amsgrad and maximize")
            lists = ([], [], [], [], [])
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                for out, t in zip(lists, (p, p.grad, st["exp_avg"], st["exp_avg_sq"], st["step"])):
                    out.append(t)
            if lists[0]:
                beta1, beta2 = group["betas"]
                self._pass(*lists, torch.tensor(float(group["lr"]), dtype=torch.float64), float(beta1), float(beta2),
                           float(group["weight_decay"]), float(group["eps"]), self.grad_scale)
        return loss


def compiles(tcfg, device: torch.device) -> bool:
    """Whether ``train.compile`` compiles on ``device``: true, or auto on CUDA (the loop's rule for
    the TTT step, and the optimizer's for its passes)."""
    mode = str(tcfg.compile).lower()
    return mode == "true" or (mode == "auto" and device.type == "cuda")


def adamw(params, tcfg, device: torch.device, sharded: bool = False, auto_compiled: bool = True) -> torch.optim.AdamW:
    """AdamW on ``device`` (where the parameters will be when it steps): fused (one kernel over all
    parameters) or :class:`CompiledAdamW` (:func:`adamw_impl`); both take the clip from :func:`fold_clip`."""
    kw = dict(lr=tcfg.lr, betas=tuple(tcfg.betas), weight_decay=tcfg.weight_decay)
    if adamw_impl(tcfg, device, sharded, auto_compiled) == "compiled":
        return CompiledAdamW(params, compile=compiles(tcfg, device), **kw)  # else the pass runs eagerly
    return torch.optim.AdamW(params, fused=device.type in ("cuda", "cpu"), **kw)


def adamw_impl(tcfg, device: torch.device, sharded: bool = False, auto_compiled: bool = True) -> str:
    """``train.adamw_impl`` resolved: fused | compiled. ``auto``: compiled on CUDA where the step is
    compiled too (train.compile auto or true) and the parameters are whole (not FSDP shards:
    ``sharded``), else fused; fused too where ``auto_compiled`` is false (Muon's AdamW half: its
    131M parameters' step measured the same either way, and compiling it would cost a compile)."""
    impl = str(tcfg.adamw_impl)
    if impl not in ("auto", "fused", "compiled"):
        raise ValueError(f"train.adamw_impl must be auto, fused or compiled, got {impl!r}")
    if impl == "compiled" and sharded:
        raise ValueError("train.adamw_impl=compiled is not supported with FSDP (its parameters are DTensor shards, "
                         "which CompiledAdamW is not tested on): use train.adamw_impl=auto or fused")
    if impl == "auto":
        return "compiled" if auto_compiled and device.type == "cuda" and compiles(tcfg, device) and not sharded \
            else "fused"
    return impl


def split_for_muon(named_params) -> tuple[list, list]:
    """(Muon's, AdamW's) (name, parameter) lists: Muon gets the trainable 2-D matrices (both sides
    > 1) except lm_head and embeddings; AdamW everything else (norms, biases, lm_head)."""
    muon, rest = [], []
    for name, p in named_params:
        if not p.requires_grad:
            continue
        if p.ndim == 2 and min(p.shape) > 1 and not any(h in name for h in ("lm_head", "embed_tokens")):
            muon.append((name, p))
        else:
            rest.append((name, p))
    return muon, rest


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon over ``muon_params`` and AdamW over ``adamw_params`` as one optimizer.

    Its ``param_groups`` are the two inner optimizers' group dicts (Muon's first) and its ``state``
    is theirs (the parameter sets are disjoint), so an LR scheduler scales both groups, and
    ``state_dict``/``load_state_dict`` (torch's own, over the combined groups) save and restore both
    exactly; after a load the inner optimizers are pointed at the loaded groups and state again."""

    def __init__(self, muon_params: list, adamw_params: list, tcfg, fused: bool, sharded: bool = False,
                 device: torch.device | None = None):
        if not muon_params:
            raise ValueError("train.optimizer=muon: the draft has no 2-D weight for Muon")
        impl = tcfg.muon_impl
        if impl not in ("fast", "torch"):
            raise ValueError(f"train.muon_impl must be fast or torch, got {impl!r}")
        kw = dict(lr=tcfg.muon_lr, weight_decay=tcfg.muon_weight_decay, momentum=tcfg.muon_momentum,
                  ns_steps=tcfg.muon_ns_steps, adjust_lr_fn=tcfg.muon_adjust_lr_fn)
        params = [p for _, p in muon_params]
        if impl == "fast":
            # train.compile: auto compiles FastMuon's two passes on CUDA only, as it does the forward
            compile_ = {"auto": None, "true": True, "false": False}[str(tcfg.compile).lower()]
            self.muon = FastMuon(params, shard=bool(tcfg.muon_shard), compile=compile_,
                                 sym=tcfg.muon_sym, **kw)
        else:
            self.muon = torch.optim.Muon(params, **kw)
        rest = [p for _, p in adamw_params]
        # where the parameters will step (the loop builds the optimizer before Accelerate moves them)
        device = device if device is not None else params[0].device
        self.adamw = (adamw(rest, tcfg, device, sharded, auto_compiled=False) if fused else
                      torch.optim.AdamW(rest, lr=tcfg.lr, betas=tuple(tcfg.betas), weight_decay=tcfg.weight_decay))
        self.muon_names = [n for n, _ in muon_params]
        super().__init__(self.muon.param_groups + self.adamw.param_groups, defaults={})
        self._share()

    @property
    def grad_scale(self):
        """What the gradients are divided by in the next step (:func:`fold_clip`), for both halves:
        FastMuon and fused AdamW read it the same way; None: as they are."""
        return getattr(self.adamw, "grad_scale", None)

    @grad_scale.setter
    def grad_scale(self, value) -> None:
        self.adamw.grad_scale = value
        if isinstance(self.muon, FastMuon):
            self.muon.grad_scale = value

    def _share(self) -> None:
        n = len(self.muon.param_groups)
        self.muon.param_groups, self.adamw.param_groups = self.param_groups[:n], self.param_groups[n:]
        self.muon.state = self.adamw.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)  # replaces self.param_groups and self.state
        self._share()

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        self.muon.step()
        self.adamw.step()
        return loss


def build_optimizer(model: torch.nn.Module, tcfg, device: torch.device, sharded: bool = False) -> torch.optim.Optimizer:
    """``train.optimizer``: AdamW over every parameter (:func:`adamw`), or :class:`MuonWithAdamW`.
    ``sharded``: the parameters will be FSDP shards (AdamW then fused)."""
    if tcfg.optimizer == "adamw":
        return adamw(model.parameters(), tcfg, device, sharded)
    muon, rest = split_for_muon(model.named_parameters())
    return MuonWithAdamW(muon, rest, tcfg, fused=device.type in ("cuda", "cpu"), sharded=sharded, device=device)


def check_optimizer_distribution(accelerator, tcfg) -> None:
    """Refuse Muon under FSDP: its Newton-Schulz step needs each whole matrix, FSDP2 hands the
    optimizer DTensor shards, and torch 2.13's Muon has no DTensor path of its own (whether DTensor's
    op dispatch makes it correct, and at what gather cost, is not tested here)."""
    from accelerate.utils import DistributedType

    if tcfg.optimizer == "muon" and accelerator.distributed_type == DistributedType.FSDP:
        raise ValueError("train.optimizer=muon is not supported with FSDP: Muon orthogonalises whole 2-D "
                         "weights and FSDP shards them (untested here). Train with DDP (the draft fits one "
                         "device) or use train.optimizer=adamw.")


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
    """Whether ``optimizer`` applies ``grad_scale`` itself: torch's fused Adam/AdamW, or FastMuon
    with fused AdamW (:class:`MuonWithAdamW`)."""
    if isinstance(optimizer, MuonWithAdamW):
        return isinstance(optimizer.muon, FastMuon) and can_fold(optimizer.adamw)
    return isinstance(optimizer, CompiledAdamW) or (isinstance(optimizer, torch.optim.Adam)
                                                     and bool(optimizer.defaults.get("fused")))


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
