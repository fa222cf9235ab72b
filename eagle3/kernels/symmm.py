"""Symmetric batched matrix products on the GPU in one Triton kernel: only the tiles on and above
the diagonal are multiplied; each tile above the diagonal is written twice, as itself and transposed.

Every m x m product of Muon's Gram-form Newton-Schulz is symmetric (``X X^T``, and products of
polynomials in one Gram matrix, which commute), as are ``X X^T`` and ``A^2`` of the standard form.
Multiplying only the upper tile-triangle costs ``T (T + 1) / 2`` of the ``T^2`` tiles (T = m / 128:
51.6% at m = 4096), against 75% for two cuBLAS row panels (:func:`eagle3.kernels.muon.sym_baddbmm`),
in one launch instead of one smaller GEMM per panel, with the panels' mirror copy folded into the
kernel's stores. Each element of the result is written once, by one program (deterministic).

:func:`sym_mm` computes ``alpha A B + beta C + diag I`` for a contiguous A (batch, m, k) and B
(batch, k, m) that is ``X.mT`` of a contiguous X (a Gram product) or a contiguous symmetric matrix,
whose product is symmetric (C symmetric too: only its upper tiles are read). Both operands are read
as rows (TMA tensor descriptors on Hopper), float32 accumulation, the scalars applied in float32 in
the epilogue (as cuBLAS's ``baddbmm``), the result rounded once to the inputs' dtype.
:func:`supported` says whether a product can run here (CUDA, Triton importable, float16/bfloat16,
m a multiple of the tile and at least :data:`MIN_ROWS`, k of the k-step); where not, callers use
the panels. :data:`CONFIGS` are the kernel variants that were timed against each other (all
compute bit-identical results); :func:`pick_config` the one used per shape.

Its speed against cuBLAS: bench/results/muon_sym_h200_202612.md (history:
bench/results/kernels_history_202612.md).

The tile schedule (:func:`tile_pairs`) walks groups of :data:`GROUP` tile-rows, column by column
inside a group, so the programs running together share their A rows and B columns in L2.
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

BLOCK = 128
"""Tile edge: the result's tiles are BLOCK x BLOCK."""
GROUP = 8
"""Tile-rows per group of the launch order (:func:`tile_pairs`)."""
CONFIGS = {  # name: (loads, BLOCK_K, num_warps, num_stages, warp-specialised k-loop)
    "tma-k64w8s4": ("tma", 64, 8, 4, False),
    "tma-k64w8s3-ws": ("tma", 64, 8, 3, True),
    "tma-k64w8s4-ws": ("tma", 64, 8, 4, True),
    "tma-k64w4s3": ("tma", 64, 4, 3, False),
    "ptr-k64w8s4": ("ptr", 64, 8, 4, False),
    "ptr-k64w4s3": ("ptr", 64, 4, 3, False),
}
"""The kernel variants timed in bench/results/muon_sym_h200_202612.md. One tile and one k-step: each
sums the same products in the same order, and their results are equal bit for bit
(tests/gpu/test_symmm_gpu.py), so a variant changes the speed, not the result. (Larger tiles and a
persistent kernel were tried and dropped: bench/results/muon_sym_h200_202612.md and
step_levers_h200_202612.md.)"""
LONG_K_CONFIG, SQUARE_CONFIG = "tma-k64w8s3-ws", "tma-k64w8s4"


def pick_config(m: int, k: int) -> str:
    """The configuration for an m x m result over k: a warp-specialised three-stage k-loop for the
    Gram products' long k (k >= 2 m), the plain four-stage one for m x m products; a fixed choice, as
    timing the variants at run time gained no more than their spread between calls
    (bench/results/muon_sym_h200_202612.md, step_levers_h200_202612.md)."""
    return LONG_K_CONFIG if k >= 2 * m else SQUARE_CONFIG


MIN_ROWS = 2048
"""Smallest m the kernel is used for: below it the upper triangle has too few tiles to fill the GPU
(cuBLAS's whole product was faster at m = 1024: bench/results/muon_sym_h200_202612.md)."""


@functools.lru_cache(maxsize=None)
def _triton():
    """(the Triton module, the pointer-load kernel, the TMA kernel), or None where Triton cannot be
    imported."""
    try:
        import triton

        from eagle3.kernels import _symmm_kernels as k
    except Exception:  # noqa: BLE001 - any import failure means: not here
        return None
    return triton, k.sym_kernel_ptr, k.sym_kernel_tma


def available() -> bool:
    """Whether Triton imports here (the kernel still needs a CUDA tensor)."""
    return _triton() is not None


def _rows(B: Tensor) -> Tensor:
    """Bt with B = Bt^T: the rows the kernel reads. B is either the transpose of a contiguous
    (batch, m, k) tensor (X X^T: B = X.mT) or a contiguous symmetric (batch, m, m) tensor (B^T = B)."""
    return B.mT if B.mT.is_contiguous() else B


def supported(A: Tensor, B: Tensor, config: str | None = None) -> bool:
    """Whether :func:`sym_mm` can multiply A (batch, m, k) by B (batch, k, m) here: CUDA, Triton,
    float16/bfloat16, m a multiple of the tile and at least :data:`MIN_ROWS`, k of the k-step, A
    contiguous and B as :func:`sym_mm` takes it; ``config`` None: :func:`pick_config`'s."""
    if not (A.is_cuda and A.dim() == 3 and B.dim() == 3 and A.dtype in (torch.float16, torch.bfloat16)):
        return False
    nb, m, k = A.shape
    bk = CONFIGS[config or pick_config(m, k)][1]
    square_b = B.is_contiguous() and B.shape[1] == B.shape[2]
    return (B.dtype == A.dtype and tuple(B.shape) == (nb, k, m) and m % BLOCK == 0 and m >= MIN_ROWS
            and k % bk == 0 and A.is_contiguous() and (B.mT.is_contiguous() or square_b) and available())


def tri_fraction(m: int) -> float:
    """The share of a whole m x m product's FLOPs that :func:`sym_mm` computes (its tile triangle)."""
    t = max(1, m // BLOCK)
    return t * (t + 1) / 2 / t ** 2


@functools.lru_cache(maxsize=None)
def _pairs_cpu(tiles: int, group: int) -> tuple:
    out = []
    for g0 in range(0, tiles, group):
        for j in range(g0, tiles):
            for i in range(g0, min(g0 + group, j + 1)):
                out.append((i, j))
    return tuple(out)


def tile_pairs(tiles: int, group: int = GROUP) -> list[tuple[int, int]]:
    """Every tile (i, j), i <= j < ``tiles``, once, in launch order: groups of ``group`` tile-rows,
    and in a group column by column (j), its rows (i <= j) inside."""
    return list(_pairs_cpu(tiles, group))


_PAIRS: dict = {}


def _pairs_on(tiles: int, device: torch.device) -> Tensor:
    key = (tiles, device)
    if key not in _PAIRS:
        _PAIRS[key] = torch.tensor(_pairs_cpu(tiles, GROUP), dtype=torch.int32, device=device).flatten()
    return _PAIRS[key]


def sym_mm(A: Tensor, B: Tensor, C: Tensor | None = None, alpha: float = 1.0, beta: float = 0.0,
           diag: float = 0.0, config: str | None = None, out: Tensor | None = None) -> Tensor:
    """``alpha A B + beta C + diag I`` (C None: no C term) for a symmetric (batch, m, m) product of
    a contiguous A (batch, m, k) and B (batch, k, m), which is either ``X.mT`` of a contiguous X
    (the Gram product X X^T) or a contiguous symmetric matrix (the caller's promise: the kernel reads
    its rows as its columns); into ``out`` (batch, m, m), or a new tensor, in A's dtype. Only the
    upper tile-triangle is multiplied (and of C read); see the module docstring. ``config``: one of
    :data:`CONFIGS`, None: :func:`pick_config`'s."""
    config = config or pick_config(A.shape[1], A.shape[2])
    if not supported(A, B, config):
        raise ValueError(f"sym_mm: unsupported inputs {tuple(A.shape)} {A.dtype} {A.device} x {tuple(B.shape)} "
                         f"{B.dtype} (needs CUDA, Triton, float16/bfloat16, a contiguous A, B = X.mT or symmetric "
                         f"contiguous, m % {BLOCK} == 0 and m >= {MIN_ROWS}, k % {CONFIGS[config][1]} == 0)")
    triton, kernel_ptr, kernel_tma = _triton()
    loads, bk, warps, stages, ws = CONFIGS[config]
    nb, m, k = A.shape
    if out is None:
        out = torch.empty(nb, m, m, dtype=A.dtype, device=A.device)
    elif tuple(out.shape) != (nb, m, m) or out.dtype != A.dtype or out.device != A.device:
        raise ValueError(f"sym_mm: out is {tuple(out.shape)} {out.dtype}, needs {(nb, m, m)} {A.dtype}")
    Bt = _rows(B)
    pairs = _pairs_on(m // BLOCK, A.device)
    Cx = C if C is not None else out
    grid = (pairs.numel() // 2, nb)
    common = (Cx.stride(0), Cx.stride(1), Cx.stride(2), out.stride(0), out.stride(1), out.stride(2),
              float(alpha), float(beta), float(diag))
    if loads == "tma":
        from triton.tools.tensor_descriptor import TensorDescriptor

        a_desc = TensorDescriptor.from_tensor(A.view(nb * m, k), [BLOCK, bk])
        b_desc = TensorDescriptor.from_tensor(Bt.reshape(nb * m, k), [BLOCK, bk])
        kernel_tma[grid](a_desc, b_desc, Cx, out, pairs, m, k, *common,
                         HAS_C=C is not None, BM=BLOCK, BK=bk, WS=ws, num_warps=warps, num_stages=stages)
    else:
        kernel_ptr[grid](A, Bt, Cx, out, pairs, k, A.stride(0), A.stride(1), A.stride(2),
                         Bt.stride(0), Bt.stride(1), Bt.stride(2), *common,
                         HAS_C=C is not None, BM=BLOCK, BK=bk, num_warps=warps, num_stages=stages)
    return out
