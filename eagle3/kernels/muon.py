"""FastMuon: ``torch.optim.Muon``'s update in fewer FLOPs and fewer, larger kernels.

A subclass of ``torch.optim.Muon`` (the same arguments, group keys and ``{"momentum_buffer"}``
state: a checkpoint of either loads into the other). What differs is how the momentum is
orthogonalised: same-shape matrices (after the transpose to m <= n) are stacked into batched calls,
and each shape runs whichever Newton-Schulz form has fewer FLOPs (:func:`ns_flops`):

* **Gram form** (:func:`gram_newton_schulz`), for wide matrices: the iteration runs on the m x m
  Gram matrix ``R = X X^T`` (``P = a I + b R + c R^2``, ``Q <- P Q``, ``R <- P R P``) and touches X
  only to form R and apply Q. R drifts in half precision (spurious negative eigenvalues the polynomial
  blows up), so, as Dao et al.'s Gram Newton-Schulz, it restarts once after iteration 2 and runs in
  float16 on CUDA (float32 on CPU), with power-of-two scalings of X and ``R = gamma X X^T`` that keep
  fp16 off its subnormals and its overflow.
* **Standard form** (:func:`newton_schulz`), for square-ish matrices: torch's bf16 iteration.

The symmetric m x m products compute their upper triangle only (:func:`sym_product`: the Triton
tile triangle of :mod:`eagle3.kernels.symmm` on CUDA, ``train.muon_sym``; cuBLAS row panels
elsewhere). With ``shard`` (DDP) each process orthogonalises its share of the matrices
(:func:`shard_owners`) and one all-reduce shares the results. Momentum, weight decay and the update
run as two passes per shape group (:func:`momentum_stack`, :func:`apply_updates`), compiled on CUDA,
the gradient clip folded into the first (``grad_scale``).

Accuracy against a float64 iteration: tests/test_optim_muon.py (CPU), tests/gpu/test_muon_gpu.py.
What each choice was measured to bring: bench/results/kernels_history_202612.md.
"""
from __future__ import annotations

import contextlib
import logging
import math
from collections import defaultdict

import torch
from torch import Tensor

log = logging.getLogger("eagle3.train")

RESTART = 2
"""Iteration before which the Gram form recomputes R from the current iterate."""
SYM_PANEL_ROWS = 2048
"""Rows per panel of a symmetric product (:func:`sym_panels`): smaller panels save more FLOPs but run
as smaller, less efficient GEMMs (at m = 4096, 2048-row panels were the best or near-best choice on
every group of the 8B draft; see the module docstring)."""
SYM_MAX_PANELS = 4


SYM_CHOICES = ("auto", "triton", "panels")


def resolve_sym(sym: str, device: torch.device) -> str:
    """``train.muon_sym``: auto -> triton on CUDA where Triton imports (:mod:`eagle3.kernels.symmm`),
    panels elsewhere; triton asked for where it cannot run is an error that says why."""
    from eagle3.kernels import symmm

    if sym == "auto":
        return "triton" if device.type == "cuda" and symmm.available() else "panels"
    if sym == "triton" and (device.type != "cuda" or not symmm.available()):
        why = "the parameters are not on a CUDA device" if device.type != "cuda" else "Triton cannot be imported"
        raise ValueError(f"train.muon_sym=triton cannot run here: {why}; use train.muon_sym=auto or panels")
    return sym


def closure_loss(closure):
    """What a torch optimizer's ``step(closure)`` returns: ``closure()`` evaluated with gradients
    enabled (it recomputes the loss), or None without one."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def sym_panels(m: int) -> int:
    """Row panels for a symmetric m x m product of the Gram form: 1 (one whole GEMM) below
    2 x :data:`SYM_PANEL_ROWS` rows, else panels of >= that many rows, at most :data:`SYM_MAX_PANELS`."""
    return max(1, min(SYM_MAX_PANELS, m // SYM_PANEL_ROWS))


def panel_edges(m: int, panels: int) -> list[int]:
    """Row boundaries of ``panels`` near-equal panels of m rows, inner ones on multiples of 8."""
    return [0] + [(m * i // panels) // 8 * 8 for i in range(1, panels)] + [m]


def sym_fraction(m: int, panels: int) -> float:
    """The share of a whole m x m product's FLOPs that :func:`sym_baddbmm` computes with ``panels``."""
    e = panel_edges(m, panels)
    return sum((r1 - r0) * (m - r0) for r0, r1 in zip(e, e[1:])) / m ** 2


def sym_kind(m: int, sym: str) -> str:
    """How the symmetric products of an m x m result run for ``sym`` (triton | panels): the Triton
    tile triangle (:mod:`eagle3.kernels.symmm`) where asked for and m is a multiple of its tile and at
    least its ``MIN_ROWS``, else cuBLAS row panels."""
    from eagle3.kernels import symmm

    if sym not in ("triton", "panels"):
        raise ValueError(f"sym must be triton or panels, got {sym!r}")
    return "triton" if sym == "triton" and m % symmm.BLOCK == 0 and m >= symmm.MIN_ROWS else "panels"


def ns_flops(m: int, n: int, steps: int, gram: bool, restart: int = RESTART, panels: int = 1,
             sym: str = "panels") -> int:
    """Matmul FLOPs of ``steps`` Newton-Schulz iterations on one m x n matrix, standard form or
    :func:`gram_newton_schulz` (a multiply-add = 2 FLOPs; elementwise terms left out), the symmetric
    products computed in ``panels`` (:func:`sym_baddbmm`; 1: whole) or, with ``sym`` triton, as
    the Triton kernel's tile triangle (:func:`eagle3.kernels.symmm.tri_fraction`)."""
    from eagle3.kernels import symmm

    m, n = min(m, n), max(m, n)
    f = symmm.tri_fraction(m) if sym_kind(m, sym) == "triton" else sym_fraction(m, panels)
    if not gram:  # X X^T (symmetric), A^2 (symmetric), B X
        return round(steps * ((1 + f) * 2 * m * m * n + f * 2 * m ** 3))
    grams, rect, square = 1, 0, 0  # X X^T GEMMs (R_0 first), other m x n GEMMs, m x m GEMMs (all symmetric)
    fresh = True  # Q is the identity (after the start or a restart)
    for k in range(steps):
        if k == restart and 0 < k:
            rect += 1  # X = Q X
            grams += 1  # R = X X^T
            fresh = True
        square += 1 + (not fresh)  # R^2, then P Q unless Q = I
        fresh = False
        if k < steps - 1 and k + 1 != restart:
            square += 2  # R <- P R P
    rect += 1  # Q X
    return round((f * grams + rect) * 2 * m * m * n + f * square * 2 * m ** 3)


def use_gram(m: int, n: int, steps: int, panels: int | None = None, sym: str = "panels") -> bool:
    """Whether the Gram form takes fewer FLOPs than the standard iteration at this shape, both with
    ``panels`` (default: whole GEMMs, which measured faster than panels for the standard form's
    square shapes: bench/results/kernels_history_202612.md)."""
    p = 1 if panels is None else panels
    return ns_flops(m, n, steps, True, panels=p, sym=sym) < ns_flops(m, n, steps, False, panels=p, sym=sym)


def sym_baddbmm(C: Tensor | None, A: Tensor, B: Tensor, beta: float = 1.0, alpha: float = 1.0,
                panels: int = 1) -> Tensor:
    """``beta C + alpha A B`` for a (batch, m, k) x (batch, k, m) product that is symmetric (X X^T, or
    two commuting symmetric matrices; C symmetric too); C None: ``alpha A B``. With ``panels`` > 1
    only the upper block-triangle is multiplied, one row panel per GEMM (written in place through
    ``out=``), and each panel's part right of its diagonal block is mirrored below it."""
    if panels <= 1:
        if C is None:
            return torch.bmm(A, B) if alpha == 1.0 else torch.baddbmm(
                A.new_empty(A.shape[0], A.shape[1], B.shape[2]), A, B, beta=0, alpha=alpha)
        return torch.baddbmm(C, A, B, beta=beta, alpha=alpha)
    m = A.shape[1]
    out = A.new_empty(A.shape[0], m, m)
    e = panel_edges(m, panels)
    for r0, r1 in zip(e, e[1:]):
        o = out[:, r0:r1, r0:]
        if C is None:  # beta = 0: the uninitialised input is ignored, NaNs included
            torch.baddbmm(o, A[:, r0:r1], B[:, :, r0:], beta=0, alpha=alpha, out=o)
        else:
            torch.baddbmm(C[:, r0:r1, r0:], A[:, r0:r1], B[:, :, r0:], beta=beta, alpha=alpha, out=o)
        if r1 < m:
            out[:, r1:, r0:r1].copy_(o[:, :, r1 - r0:].mT)
    return out


def sym_product(C: Tensor | None, A: Tensor, B: Tensor, beta: float = 1.0, alpha: float = 1.0, panels: int = 1,
                diag: float = 0.0, sym: str = "panels") -> Tensor:
    """``beta C + alpha A B + diag I`` for a symmetric (batch, m, m) product (as :func:`sym_baddbmm`):
    with ``sym`` triton and inputs the kernel takes, one launch of the Triton tile triangle
    (:func:`eagle3.kernels.symmm.sym_mm`); else cuBLAS row panels."""
    from eagle3.kernels import symmm

    if sym == "triton" and symmm.supported(A, B):
        return symmm.sym_mm(A, B, C, alpha=alpha, beta=beta if C is not None else 0.0, diag=diag)
    out = sym_baddbmm(C, A, B, beta=beta, alpha=alpha, panels=panels)
    if diag:
        out.diagonal(dim1=-2, dim2=-1).add_(diag)
    return out


def normalised(X: Tensor, eps: float) -> Tensor:
    """(B, m, n) bf16 -> each matrix divided by its Frobenius norm (clamped to eps), as torch's Muon."""
    norm = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True)
    return X / norm.clamp(min=eps)


def newton_schulz(X: Tensor, coeffs: tuple[float, float, float], steps: int, panels: int = 1,
                  sym: str = "panels") -> Tensor:
    """torch's quintic iteration on a (B, m, n) stack of normalised bf16 matrices (m <= n); the
    symmetric products (X X^T, A^2) in ``panels`` (default: whole) or the Triton tile triangle
    (``sym`` triton; see :func:`sym_product` and the module docstring)."""
    a, b, c = coeffs
    for _ in range(steps):
        A = sym_product(None, X, X.mT, panels=panels, sym=sym)
        B = sym_product(A, A, A, beta=b, alpha=c, panels=panels, sym=sym)
        X = torch.baddbmm(X, B, X, beta=a)
    return X


@contextlib.contextmanager
def _full_fp16_accumulation(cuda: bool):
    """cuBLAS may reduce fp16 GEMMs in fp16 (split-K) unless told not to: not here."""
    if not cuda:
        yield
        return
    flag = torch.backends.cuda.matmul
    old = flag.allow_fp16_reduced_precision_reduction
    flag.allow_fp16_reduced_precision_reduction = False
    try:
        yield
    finally:
        flag.allow_fp16_reduced_precision_reduction = old


def gram_dtype(device: torch.device) -> torch.dtype:
    """float16 on CUDA (tensor cores at bf16's rate); float32 elsewhere (CPUs have no fast fp16 GEMM)."""
    return torch.float16 if device.type == "cuda" else torch.float32


def gram_newton_schulz(X: Tensor, coeffs: tuple[float, float, float], steps: int,
                       dtype: torch.dtype | None = None, restart: int = RESTART, panels: int | None = None,
                       sym: str = "panels") -> Tensor:
    """The iterate of :func:`newton_schulz` (equal in exact arithmetic) on a (B, m, n) stack of
    normalised matrices (m <= n), through m x m matrices, in ``dtype`` (default :func:`gram_dtype`);
    returns bf16 like it. The symmetric products in ``panels`` (default :func:`sym_panels`)."""
    dtype = dtype or gram_dtype(X.device)
    s = gram_scale(*X.shape[-2:])
    Xs = (X * s).to(dtype)  # a power of two: exact in bf16, before fp16 could flush small entries
    return gram_newton_schulz_scaled(Xs, s, coeffs, steps, restart, panels, sym).to(torch.bfloat16).mul_(1.0 / s)


def gram_scale(m: int, n: int) -> float:
    """s of the Gram form's X_s = s X: a power of two near sqrt(m n) / 64, so that a normalised
    matrix's entries are ~ 1/64 in RMS and at most s (away from float16's subnormals)."""
    return 2.0 ** math.floor(math.log2(max(1.0, math.sqrt(m * n) / 64)))


def gram_newton_schulz_scaled(Xs: Tensor, s: float, coeffs: tuple[float, float, float], steps: int,
                              restart: int = RESTART, panels: int | None = None, sym: str = "panels") -> Tensor:
    """:func:`gram_newton_schulz` on ``Xs`` = s X (already in the Gram dtype, s = :func:`gram_scale`);
    returns s times the iterate, in that dtype."""
    a, b, c = coeffs
    m, n = Xs.shape[-2:]
    p = sym_panels(m) if panels is None else panels
    gamma = min(math.sqrt(m), 64.0)  # R_hat = gamma R: R's eigenvalues are <= ~1.44 (a NS iterate's s.v. <= 1.2)
    bh, ch = b / gamma, c / gamma ** 2  # P = a I + b R + c R^2 = a I + bh R_hat + ch R_hat^2
    with _full_fp16_accumulation(Xs.is_cuda):
        def gram(Y):  # gamma (Y / s)(Y / s)^T, scaled in the GEMM's float32 epilogue
            return sym_product(None, Y, Y.mT, alpha=gamma / s ** 2, panels=p, sym=sym)

        def mul(U, V):  # a product of two polynomials in one R: they commute, it is symmetric
            return sym_product(None, U, V, panels=p, sym=sym)

        R, Q = gram(Xs), None
        for k in range(steps):
            if k == restart and k > 0:
                Xs, Q = torch.bmm(Q, Xs), None
                R = gram(Xs)
            P = sym_product(R, R, R, beta=bh, alpha=ch, panels=p, diag=a, sym=sym)
            Q = P if Q is None else mul(P, Q)
            if k < steps - 1 and k + 1 != restart:
                R = mul(mul(P, R), P)
        return torch.bmm(Q, Xs)


def chosen_form(m: int, n: int, steps: int, gram: str = "auto", panels: int | None = None,
                sym: str = "panels") -> tuple[bool, int]:
    """(whether the Gram form is used, the symmetric products' panels) for an m x n matrix (m <= n):
    ``gram`` auto | always | never; ``panels`` None: :func:`sym_panels` in the Gram form, whole GEMMs
    in the standard form; with ``sym`` triton (where :func:`sym_kind` takes it) the form of fewer
    FLOPs with the tile triangle (the panels then serve a product the kernel cannot take, as in the
    Gram form with a float32 ``gram_dtype``). What :func:`orthogonalise` runs and :func:`ns_cost`
    counts."""
    g = gram == "always" or (gram == "auto" and use_gram(m, n, steps, panels, sym))
    return g, panels if panels is not None else (sym_panels(m) if g else 1)


def orthogonalise(mats: list[Tensor], coeffs, steps: int, eps: float, gram: str = "auto",
                  dtype: torch.dtype | None = None, panels: int | None = None, sym: str = "panels") -> list[Tensor]:
    """torch's ``_zeropower_via_newtonschulz`` of each matrix (bf16, in the matrix's own orientation),
    same-shape matrices batched; ``gram``: auto (the Gram form where it takes fewer FLOPs) | always
    | never; ``dtype``: the Gram form's (default :func:`gram_dtype`); ``panels``: the symmetric
    products' (default: :func:`sym_panels` of each shape in the Gram form, whole in the standard form);
    ``sym``: triton | panels (:func:`sym_kind`)."""
    groups: dict[tuple, list[int]] = defaultdict(list)  # by (m, n) after the transpose: gate/up with down
    for i, g in enumerate(mats):
        groups[(min(g.shape), max(g.shape), g.device)].append(i)
    out: list = [None] * len(mats)
    for (m, n, _), idx in groups.items():
        tall = [mats[i].shape[0] > mats[i].shape[1] for i in idx]
        X = torch.stack([(mats[i].mT if t else mats[i]).bfloat16() for i, t in zip(idx, tall)])
        X = normalised(X, eps)
        use, p = chosen_form(m, n, steps, gram, panels, sym)
        X = gram_newton_schulz(X, coeffs, steps, dtype, panels=p, sym=sym) if use else \
            newton_schulz(X, coeffs, steps, p, sym)
        for j, (i, t) in enumerate(zip(idx, tall)):
            out[i] = X[j].mT if t else X[j]
    return out


def ns_cost(shape, steps: int, gram: str = "auto", sym: str = "panels") -> int:
    """Newton-Schulz FLOPs :func:`orthogonalise` spends on one matrix of ``shape`` (its form and
    panels or tile triangle), the measure :func:`shard_owners` balances."""
    m, n = min(shape), max(shape)
    g, p = chosen_form(m, n, steps, gram, sym=sym)
    return ns_flops(m, n, steps, g, panels=p, sym=sym)


def shard_owners(costs: list, world: int) -> list[int]:
    """Each matrix's process for ``world`` processes: the costliest first, each to the least-loaded
    process (ties: the lower index, then the lower rank). A pure function of the costs: every process
    computes the same plan."""
    load = [0] * world
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += costs[i]
    return owner


def _world() -> tuple[int, int]:
    """(processes, this one's rank) of the default process group; (1, 0) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def momentum_stack(grads: list[Tensor], bufs: list[Tensor], tall: list[bool], momentum: float, nesterov: bool,
                   inv_scale: Tensor | None, eps: float, s: float, dtype: torch.dtype) -> Tensor:
    """One pass of FastMuon's step over a same-shape group, before the iteration: each momentum
    buffer updated in place (``buf.lerp_(g, 1 - momentum)``, ``g`` times ``inv_scale``: the clip
    folded in), the update (Nesterov: ``g.lerp(buf, momentum)``) rounded to bf16 as torch's Muon
    rounds it, transposed where tall, stacked and divided by its Frobenius norm (:func:`normalised`),
    then times ``s`` in ``dtype`` (the Gram form's input; s = 1 and bf16 for the standard form).
    Compiled on CUDA: one or two kernels instead of some ten passes over the gradients."""
    us = []
    for g, buf, t in zip(grads, bufs, tall):
        if inv_scale is not None:
            g = g * inv_scale
        buf.lerp_(g, 1 - momentum)
        u = (g.lerp(buf, momentum) if nesterov else buf).bfloat16()
        us.append(u.mT if t else u)
    X = normalised(torch.stack(us), eps)
    return X if s == 1.0 and dtype == torch.bfloat16 else (X * s).to(dtype)


def apply_updates(params: list[Tensor], Y: Tensor, tall: list[bool], decay: Tensor, lr: Tensor, factors: list[float],
                  inv_s: float) -> None:
    """One pass after the iteration: ``param.mul_(decay).add_(u, alpha=-lr * factor)`` with u the bf16
    update (``Y[j]`` in bf16 times ``inv_s``, a power of two, transposed back where tall) and factor
    ``adjust_lr_fn``'s for the shape, as torch's Muon applies it. Compiled on CUDA: ``decay`` and
    ``lr`` change every step, so they come as 0-d CPU tensors (as Python floats they would be
    compiled in as constants: a new graph for every learning rate)."""
    for j, (p, t) in enumerate(zip(params, tall)):
        u = Y[j].to(torch.bfloat16) * inv_s
        p.mul_(decay).sub_((u.mT if t else u).to(p.dtype) * factors[j] * lr)


def _adjust_lr(lr: float, adjust_lr_fn: str | None, shape) -> float:
    """torch.optim._muon._adjust_lr (the same formula; torch's is private)."""
    A, B = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, A / B))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(A, B))
    return lr


class FastMuon(torch.optim.Muon):
    """``torch.optim.Muon`` with :func:`orthogonalise`'s iteration (the Gram form where it takes
    fewer FLOPs, same-shape matrices batched) and one pass before and one after it per shape group
    (:func:`momentum_stack`, :func:`apply_updates`; compiled on CUDA). The same arguments, groups,
    state and state_dict; ``gram``: auto | always | never (never: torch's iteration, batched);
    ``gram_dtype``: the Gram form's (default float16 on CUDA, float32 elsewhere); ``shard``: in a
    default process group of several processes holding the same gradients (DDP), each orthogonalises
    its share of the matrices and they are shared in one all-reduce (see the module docstring); False:
    every process computes every matrix. ``compile``: the two passes compiled (default: on CUDA).
    ``grad_scale``, as fused AdamW's: a tensor the gradients are divided by (the clip's coefficient,
    folded in by eagle3.train.optim.fold_clip); None: as they are. ``shared`` counts the matrices this
    process orthogonalised and the ones it received."""

    def __init__(self, params, *args, gram: str = "auto", gram_dtype: torch.dtype | None = None,
                 shard: bool = True, compile: bool | None = None, sym: str = "auto", **kwargs):
        super().__init__(params, *args, **kwargs)
        if gram not in ("auto", "always", "never"):
            raise ValueError(f"gram must be auto, always or never, got {gram!r}")
        if sym not in SYM_CHOICES:
            raise ValueError(f"sym must be one of {', '.join(SYM_CHOICES)}, got {sym!r}")
        self.gram, self.gram_dtype, self.shard, self.compile, self.sym = gram, gram_dtype, shard, compile, sym
        self.grad_scale: Tensor | None = None
        self.shared = {"computed": 0, "received": 0}
        self._said = False
        self._passes = None

    def _get_passes(self, device: torch.device):
        if self._passes is None:
            on = self.compile if self.compile is not None else device.type == "cuda"
            if on:
                self._passes = (torch.compile(momentum_stack, dynamic=False), torch.compile(apply_updates, dynamic=False))
            else:
                self._passes = (momentum_stack, apply_updates)
        return self._passes

    def _iterate(self, X: Tensor, gram: bool, s: float, panels: int, sym: str, group: dict) -> Tensor:
        """The iteration on a group's stacked input (:func:`momentum_stack`'s), in the chosen form."""
        if gram:
            return gram_newton_schulz_scaled(X, s, group["ns_coefficients"], group["ns_steps"], panels=panels, sym=sym)
        return newton_schulz(X, group["ns_coefficients"], group["ns_steps"], panels, sym)

    def _say_shards(self, world: int, mine: list, costs: list) -> None:
        if self._said:
            return
        log.info(
            "train: Muon's Newton-Schulz split over %d processes (train.muon_shard): process 0 orthogonalises "
            "%d of %d matrices, %.0f%% of the FLOPs, and receives the others", world, len(mine), len(costs),
            100 * sum(costs[i] for i in mine) / max(1, sum(costs)))
        self._said = True

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        for group in self.param_groups:
            params: list[Tensor] = []
            grads: list[Tensor] = []
            bufs: list[Tensor] = []
            for p in group["params"]:  # torch's Muon._init_group (kept here: its signature is private)
                if p.grad is None:
                    continue
                if torch.is_complex(p) or p.grad.is_sparse:
                    raise RuntimeError("Muon does not support complex parameters or sparse gradients")
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                params.append(p)
                grads.append(p.grad)
                bufs.append(state["momentum_buffer"])
            if not params:
                continue
            self._step_group(group, params, grads, bufs)
        return loss

    def _step_group(self, group: dict, params: list, grads: list, bufs: list) -> None:
        lr = group["lr"]
        lr = lr.item() if isinstance(lr, Tensor) else lr
        steps = group["ns_steps"]
        prep, apply = self._get_passes(params[0].device)
        inv = None if self.grad_scale is None else torch.reciprocal(self.grad_scale)
        world, rank = _world() if self.shard else (1, 0)
        sym = resolve_sym(self.sym, params[0].device)
        owner = None
        if world > 1:
            costs = [ns_cost(p.shape, steps, self.gram, sym) for p in params]
            owner = shard_owners(costs, world)
            if rank == 0:
                self._say_shards(world, [i for i, o in enumerate(owner) if o == rank], costs)
        shapes: dict[tuple, list[int]] = defaultdict(list)  # by (m, n) after the transpose: gate/up with down
        for i, p in enumerate(params):
            shapes[(min(p.shape), max(p.shape), p.device)].append(i)
        flat, off, done = None, 0, []
        if owner is not None:  # every result into one bf16 buffer, zeros where another process owns it
            flat = torch.zeros(sum(p.numel() for p in params), dtype=torch.bfloat16, device=params[0].device)
        for (m, n, device), idx in shapes.items():
            tall = [params[i].shape[0] > params[i].shape[1] for i in idx]
            gram, panels = chosen_form(m, n, steps, self.gram, sym=sym)
            dtype = (self.gram_dtype or gram_dtype(device)) if gram else torch.bfloat16
            s = gram_scale(m, n) if gram else 1.0
            X = prep([grads[i] for i in idx], [bufs[i] for i in idx], tall, group["momentum"], group["nesterov"],
                     inv, group["eps"], s, dtype)  # every process: each keeps its own momentum buffers
            mine = [j for j, i in enumerate(idx) if owner is None or owner[i] == rank]
            if flat is None:
                Y = self._iterate(X, gram, s, panels, sym, group)
            else:
                Y = flat[off:off + len(idx) * m * n].view(len(idx), m, n)
                off += len(idx) * m * n
                if mine:  # bf16 here as apply_updates rounds it: the same values as computed in place
                    Y[mine] = self._iterate(X[mine], gram, s, panels, sym, group).to(torch.bfloat16)
            self.shared["computed"] += len(mine)
            self.shared["received"] += len(idx) - len(mine)
            done.append((idx, Y, tall, 1.0 / s))
        if flat is not None:
            import torch.distributed as dist

            # one all-reduce, the collective DDP itself uses (a sum with a single non-zero term per
            # entry: exact); broadcasts from several roots aborted gloo processes at exit now and then
            dist.all_reduce(flat)
        decay = torch.tensor(1 - lr * group["weight_decay"], dtype=torch.float64)
        lr_t = torch.tensor(lr, dtype=torch.float64)
        for idx, Y, tall, inv_s in done:
            factors = [_adjust_lr(1.0, group["adjust_lr_fn"], params[i].shape) for i in idx]
            apply([params[i] for i in idx], Y, tall, decay, lr_t, factors, inv_s)
