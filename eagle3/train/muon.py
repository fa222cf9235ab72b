"""A faster ``torch.optim.Muon``: the same update in fewer FLOPs and fewer, larger kernels.

torch's Muon orthogonalises each 2-D momentum ``G`` (m x n after transposing so that m <= n,
divided by its Frobenius norm) with ``k`` quintic Newton-Schulz iterations in bfloat16,

    A = X X^T;  X <- a X + (b A + c A^2) X        4 m^2 n + 2 m^3 FLOPs per iteration,

one matrix at a time. :class:`FastMuon` computes the same iterate two ways and picks, per shape,
the one of fewer FLOPs (:func:`ns_flops`):

* **Gram form** (:func:`gram_newton_schulz`), for wide matrices. Every iterate is ``X_j = Q_j X_0``
  with ``Q_j`` a polynomial in ``R_0 = X_0 X_0^T``, so the iteration runs on m x m matrices:
  ``P = a I + b R + c R^2``, ``Q <- P Q``, ``R <- P R P`` (they commute), and X is touched only to
  form R and to apply Q. Carried along by the polynomial, R drifts from the true Gram matrix in
  half precision: rounding puts spurious negative eigenvalues into it, which the polynomial then
  blows up (measured: bf16 Gram NS with no precaution is off by 1.4x-500x of the result on
  ill-conditioned inputs). As Dao et al.'s Gram Newton-Schulz (tridao.me/blog/2026/gram-newton-schulz)
  this restarts once, after iteration 2 (``X_2 = Q X_0``, ``R = X_2 X_2^T``, ``Q = I``), and runs in
  float16 on CUDA (bf16's range is not needed once X is normalised, fp16's 3 more mantissa bits
  are; float32 on CPU, which has no fast fp16 GEMM):
  ``8 m^2 n + 28 m^3`` FLOPs for 5 iterations against ``20 m^2 n + 10 m^3``, fewer once n > 1.5 m
  (the 8B draft's 4096 x 14336 MLP matrices: 0.70 x; its 4096 x 12288 fc 0.74 x, q 0.88 x, k/v 0.54 x).
  Scalings keep fp16 away from its subnormals and its overflow: X is scaled by a power of two
  (exact), R is kept as ``gamma X X^T`` (gamma = min(sqrt(m), 64): R's eigenvalues stay <= ~1.5 gamma,
  its square < 2^15), the coefficients adjusted to match.
* **Standard form** (:func:`newton_schulz`), for square-ish matrices: torch's bf16 iteration.

**Symmetric products** (:func:`sym_baddbmm`): every m x m result of the Gram form is symmetric
(``X X^T``, and products of polynomials in the same R, which commute), so for m >= 4096 only its upper
block-triangle is computed, in row panels of >= 2048 rows (at most :data:`SYM_MAX_PANELS`), and
mirrored: with 2 panels 75% of those GEMMs' FLOPs (the 8B draft's Newton-Schulz: 20.4 -> 16.9 TFLOP a
step, :func:`ns_flops`). Only ``Q X`` stays whole. On one H200 (bench/optimizer.py,
bench/results/muon_h200_202612.md) 2 panels took the 8B draft's Gram groups from 5.98 / 5.01 / 21.47 ms
(fc, q, gate/up/down) to 5.59 / 4.53 / 17.07. In two calls 2 panels were the fastest count on fc,
fastest or within 0.5% on q, and within 3.2% of 8 panels on gate/up/down. For the standard form
(o_proj's square shape) the two calls disagreed on whether panels help at all, so it keeps whole
GEMMs by default.

Measured on CPU against a float64 iteration (tests/test_optim_muon.py): the Gram form's distance
from torch's bf16 result is below torch's own distance from float64, on Gaussian, power-law and
low-rank-plus-noise spectra.

Same-shape matrices (after the transpose) are stacked and orthogonalised in batched calls
(``torch.bmm``/``baddbmm``): the 8B draft's 8 matrices make 5 groups (gate/up/down, k/v, q, o, fc).
**Several processes** (DDP: every process holds the same all-reduced gradients, so the same
momentum): with ``shard`` each process orthogonalises only its share of the matrices
(:func:`shard_owners`: the costliest first, each to the least-loaded process, by :func:`ns_cost`)
and the results are shared in one all-reduce (zeros where another process owns a matrix: an
exact sum), so the Newton-Schulz work of a step is split over the processes
instead of repeated on each (the 8B draft's 8 matrices: one or two per process on 8 GPUs). Every
process then applies the same bf16 updates: the weights stay identical across processes.

Everything else is torch's Muon: ``FastMuon`` subclasses ``torch.optim.Muon`` (the same arguments,
group keys and ``{"momentum_buffer"}`` state, so a checkpoint of either loads into the other) and
applies momentum (``lerp``, Nesterov), decoupled weight decay and ``adjust_lr_fn`` as torch does,
with foreach ops over a group's tensors.
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


def ns_flops(m: int, n: int, steps: int, gram: bool, restart: int = RESTART, panels: int = 1) -> int:
    """Matmul FLOPs of ``steps`` Newton-Schulz iterations on one m x n matrix, standard form or
    :func:`gram_newton_schulz` (a multiply-add = 2 FLOPs; elementwise terms left out), the symmetric
    products computed in ``panels`` (:func:`sym_baddbmm`; 1: whole)."""
    m, n = min(m, n), max(m, n)
    f = sym_fraction(m, panels)
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


def use_gram(m: int, n: int, steps: int, panels: int | None = None) -> bool:
    """Whether the Gram form takes fewer FLOPs than the standard iteration at this shape, both with
    ``panels`` (default: whole GEMMs. On one H200 call at 4096 x 4096, the standard form in whole
    GEMMs took 3.14 ms and the Gram form in 2 panels 3.72 ms, although the Gram form has 7% fewer
    FLOPs there)."""
    p = 1 if panels is None else panels
    return ns_flops(m, n, steps, True, panels=p) < ns_flops(m, n, steps, False, panels=p)


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


def normalised(X: Tensor, eps: float) -> Tensor:
    """(B, m, n) bf16 -> each matrix divided by its Frobenius norm (clamped to eps), as torch's Muon."""
    norm = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True)
    return X / norm.clamp(min=eps)


def newton_schulz(X: Tensor, coeffs: tuple[float, float, float], steps: int, panels: int = 1) -> Tensor:
    """torch's quintic iteration on a (B, m, n) stack of normalised bf16 matrices (m <= n); the
    symmetric products (X X^T, A^2) in ``panels`` (default: whole; see the module docstring)."""
    a, b, c = coeffs
    for _ in range(steps):
        A = sym_baddbmm(None, X, X.mT, panels=panels)
        B = sym_baddbmm(A, A, A, beta=b, alpha=c, panels=panels)
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
                       dtype: torch.dtype | None = None, restart: int = RESTART, panels: int | None = None) -> Tensor:
    """The iterate of :func:`newton_schulz` (equal in exact arithmetic) on a (B, m, n) stack of
    normalised matrices (m <= n), through m x m matrices, in ``dtype`` (default :func:`gram_dtype`);
    returns bf16 like it. The symmetric products in ``panels`` (default :func:`sym_panels`)."""
    a, b, c = coeffs
    dtype = dtype or gram_dtype(X.device)
    m, n = X.shape[-2:]
    p = sym_panels(m) if panels is None else panels
    # X_s = s X with s a power of two near sqrt(m n) / 64: its entries ~ 1/64 in RMS, max <= s
    s = 2.0 ** math.floor(math.log2(max(1.0, math.sqrt(m * n) / 64)))
    gamma = min(math.sqrt(m), 64.0)  # R_hat = gamma R: R's eigenvalues are <= ~1.44 (a NS iterate's s.v. <= 1.2)
    bh, ch = b / gamma, c / gamma ** 2  # P = a I + b R + c R^2 = a I + bh R_hat + ch R_hat^2
    with _full_fp16_accumulation(X.is_cuda):
        Xs = (X * s).to(dtype)  # a power of two: exact in bf16, before fp16 could flush small entries

        def gram(Y):  # gamma (Y / s)(Y / s)^T, scaled in the GEMM's float32 epilogue
            return sym_baddbmm(None, Y, Y.mT, alpha=gamma / s ** 2, panels=p)

        R, Q = gram(Xs), None
        for k in range(steps):
            if k == restart and k > 0:
                Xs, Q = torch.bmm(Q, Xs), None
                R = gram(Xs)
            P = sym_baddbmm(R, R, R, beta=bh, alpha=ch, panels=p)
            P.diagonal(dim1=-2, dim2=-1).add_(a)
            Q = P if Q is None else sym_baddbmm(None, P, Q, panels=p)  # polynomials in one R: they commute
            if k < steps - 1 and k + 1 != restart:
                R = sym_baddbmm(None, sym_baddbmm(None, P, R, panels=p), P, panels=p)
        out = torch.bmm(Q, Xs)
    return out.to(torch.bfloat16).mul_(1.0 / s)


def chosen_form(m: int, n: int, steps: int, gram: str = "auto", panels: int | None = None) -> tuple[bool, int]:
    """(whether the Gram form is used, the symmetric products' panels) for an m x n matrix (m <= n):
    ``gram`` auto | always | never; ``panels`` None: :func:`sym_panels` in the Gram form, whole GEMMs
    in the standard form. What :func:`orthogonalise` runs and :func:`ns_cost` counts."""
    g = gram == "always" or (gram == "auto" and use_gram(m, n, steps, panels))
    return g, panels if panels is not None else (sym_panels(m) if g else 1)


def orthogonalise(mats: list[Tensor], coeffs, steps: int, eps: float, gram: str = "auto",
                  dtype: torch.dtype | None = None, panels: int | None = None) -> list[Tensor]:
    """torch's ``_zeropower_via_newtonschulz`` of each matrix (bf16, in the matrix's own orientation),
    same-shape matrices batched; ``gram``: auto (the Gram form where it takes fewer FLOPs) | always
    | never; ``dtype``: the Gram form's (default :func:`gram_dtype`); ``panels``: the symmetric
    products' (default: :func:`sym_panels` of each shape in the Gram form, whole in the standard form)."""
    groups: dict[tuple, list[int]] = defaultdict(list)  # by (m, n) after the transpose: gate/up with down
    for i, g in enumerate(mats):
        groups[(min(g.shape), max(g.shape), g.device)].append(i)
    out: list = [None] * len(mats)
    for (m, n, _), idx in groups.items():
        tall = [mats[i].shape[0] > mats[i].shape[1] for i in idx]
        X = torch.stack([(mats[i].mT if t else mats[i]).bfloat16() for i, t in zip(idx, tall)])
        X = normalised(X, eps)
        use, p = chosen_form(m, n, steps, gram, panels)
        X = gram_newton_schulz(X, coeffs, steps, dtype, panels=p) if use else newton_schulz(X, coeffs, steps, p)
        for j, (i, t) in enumerate(zip(idx, tall)):
            out[i] = X[j].mT if t else X[j]
    return out


def ns_cost(shape, steps: int, gram: str = "auto") -> int:
    """Newton-Schulz FLOPs :func:`orthogonalise` spends on one matrix of ``shape`` (its form and
    panels), the measure :func:`shard_owners` balances."""
    m, n = min(shape), max(shape)
    g, p = chosen_form(m, n, steps, gram)
    return ns_flops(m, n, steps, g, panels=p)


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


def _adjust_lr(lr: float, adjust_lr_fn: str | None, shape) -> float:
    """torch.optim._muon._adjust_lr (the same formula; torch's is private)."""
    A, B = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, A / B))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(A, B))
    return lr


class FastMuon(torch.optim.Muon):
    """``torch.optim.Muon`` with :func:`orthogonalise` (the Gram form where it takes fewer FLOPs,
    same-shape matrices batched) and foreach momentum/update ops. The same arguments, groups,
    state and state_dict; ``gram``: auto | always | never (never: torch's iteration, batched);
    ``gram_dtype``: the Gram form's (default float16 on CUDA, float32 elsewhere); ``shard``: in a
    default process group of several processes holding the same gradients (DDP), each orthogonalises
    its share of the matrices and they are shared in one all-reduce (see the module docstring); False: every process
    computes every matrix. ``shared`` counts, per step, the matrices this process orthogonalised and
    the ones it received."""

    def __init__(self, params, *args, gram: str = "auto", gram_dtype: torch.dtype | None = None,
                 shard: bool = True, **kwargs):
        super().__init__(params, *args, **kwargs)
        if gram not in ("auto", "always", "never"):
            raise ValueError(f"gram must be auto, always or never, got {gram!r}")
        self.gram, self.gram_dtype, self.shard = gram, gram_dtype, shard
        self.shared = {"computed": 0, "received": 0}
        self._said = False

    def _orthogonalise(self, updates: list[Tensor], group: dict) -> list[Tensor]:
        """:func:`orthogonalise` of a group's updates: all here, or this process's share of them
        and the others' from their owners, in one all-reduce (:func:`shard_owners`)."""
        args = (group["ns_coefficients"], group["ns_steps"], group["eps"], self.gram, self.gram_dtype)
        world, rank = _world() if self.shard else (1, 0)
        if world == 1:
            self.shared["computed"] += len(updates)
            return orthogonalise(updates, *args)
        import torch.distributed as dist

        costs = [ns_cost(u.shape, group["ns_steps"], self.gram) for u in updates]
        owner = shard_owners(costs, world)
        mine = [i for i, o in enumerate(owner) if o == rank]
        if not self._said and rank == 0:
            log.info(
                "train: Muon's Newton-Schulz split over %d processes (train.muon_shard): process 0 orthogonalises "
                "%d of %d matrices, %.0f%% of the FLOPs, and receives the others", world, len(mine), len(updates),
                100 * sum(costs[i] for i in mine) / max(1, sum(costs)))
            self._said = True
        # every result into one flat bf16 buffer, zeros where another process owns the matrix, then
        # one all-reduce (a sum: each entry has a single non-zero term, so it is exact); the collective
        # DDP itself uses (broadcasts from several roots aborted gloo processes at exit now and then)
        sizes = [u.numel() for u in updates]
        flat = torch.zeros(sum(sizes), dtype=torch.bfloat16, device=updates[0].device)
        out = list(flat.split(sizes))
        for i, x in zip(mine, orthogonalise([updates[i] for i in mine], *args)):
            out[i].copy_(x.reshape(-1))
        dist.all_reduce(flat)
        out = [o.view(u.shape) for o, u in zip(out, updates)]
        self.shared["computed"] += len(mine)
        self.shared["received"] += len(updates) - len(mine)
        return out

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
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
            lr = group["lr"]
            lr = lr.item() if isinstance(lr, Tensor) else lr
            momentum, wd = group["momentum"], group["weight_decay"]
            torch._foreach_lerp_(bufs, grads, 1 - momentum)  # buf.lerp_(grad, 1 - momentum)
            updates = torch._foreach_lerp(grads, bufs, momentum) if group["nesterov"] else bufs
            ortho = self._orthogonalise(updates, group)
            del updates
            torch._foreach_mul_(params, 1 - lr * wd)  # param.mul_(1 - lr * weight_decay)
            by_lr: dict[float, list[int]] = defaultdict(list)  # param.add_(update, alpha=-adjusted_lr)
            for i, p in enumerate(params):
                by_lr[_adjust_lr(lr, group["adjust_lr_fn"], p.shape)].append(i)
            for alr, idx in by_lr.items():
                ps, us = [params[i] for i in idx], [ortho[i] for i in idx]
                if all(p.dtype == u.dtype for p, u in zip(ps, us)):
                    torch._foreach_add_(ps, us, alpha=-alr)
                else:  # float32 parameters, bf16 updates: added as torch adds them (promoted per tensor)
                    for p, u in zip(ps, us):
                        p.add_(u, alpha=-alr)
        return loss
