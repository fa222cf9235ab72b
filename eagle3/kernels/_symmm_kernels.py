"""The Triton kernels of :mod:`eagle3.kernels.symmm` (imported only where Triton is: see its docstring)."""
import triton
import triton.language as tl


@triton.jit
def epilogue(acc, C, Out, b, ti, tj, rm, rn, scb, scm, scn, sob, som, son, alpha, beta, diag, HAS_C: tl.constexpr):
    """alpha acc + beta C + diag I on tile (ti, tj) (rows rm, columns rn; ti <= tj), stored so that each
    element of the symmetric result is written once, by one program: a tile above the diagonal as itself
    and transposed, the tile on the diagonal as itself (its lower half is the product's own)."""
    acc = acc * alpha
    if HAS_C:
        acc += beta * tl.load(C + b * scb + rm[:, None] * scm + rn[None, :] * scn).to(tl.float32)
    acc = tl.where(rm[:, None] == rn[None, :], acc + diag, acc)
    out = acc.to(Out.dtype.element_ty)
    tl.store(Out + b * sob + rm[:, None] * som + rn[None, :] * son, out)
    if tj > ti:
        tl.store(Out + b * sob + rn[:, None] * som + rm[None, :] * son, tl.trans(out))


@triton.jit
def sym_kernel_ptr(A, Bt, C, Out, pairs, K,
                   sab, sam, sak, sbb, sbm, sbk, scb, scm, scn, sob, som, son,
                   alpha, beta, diag,
                   HAS_C: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    # A (batch, m, k) and Bt (batch, m, k): the product A Bt^T, pointer loads
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    ti = tl.load(pairs + 2 * pid)
    tj = tl.load(pairs + 2 * pid + 1)
    rm = ti * BM + tl.arange(0, BM)
    rn = tj * BM + tl.arange(0, BM)
    rk = tl.arange(0, BK)
    a_ptr = A + b * sab + rm[:, None] * sam + rk[None, :] * sak
    b_ptr = Bt + b * sbb + rk[:, None] * sbk + rn[None, :] * sbm
    acc = tl.zeros((BM, BM), dtype=tl.float32)
    for _ in range(0, K // BK):
        acc = tl.dot(tl.load(a_ptr), tl.load(b_ptr), acc)
        a_ptr += BK * sak
        b_ptr += BK * sbk
    epilogue(acc, C, Out, b, ti, tj, rm, rn, scb, scm, scn, sob, som, son, alpha, beta, diag, HAS_C)


@triton.jit
def sym_kernel_tma(a_desc, b_desc, C, Out, pairs, M, K,
                   scb, scm, scn, sob, som, son,
                   alpha, beta, diag,
                   HAS_C: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, WS: tl.constexpr):
    # A and Bt as (batch * m, k) row-major tensor descriptors (TMA loads): the product A Bt^T
    pid = tl.program_id(0)
    b = tl.program_id(1)
    ti = tl.load(pairs + 2 * pid)
    tj = tl.load(pairs + 2 * pid + 1)
    row_a = b * M + ti * BM
    row_b = b * M + tj * BM
    acc = tl.zeros((BM, BM), dtype=tl.float32)
    for k in tl.range(0, K, BK, warp_specialize=WS):
        a = a_desc.load([row_a, k])
        bt = b_desc.load([row_b, k])
        acc = tl.dot(a, bt.T, acc)
    rm = ti * BM + tl.arange(0, BM)
    rn = tj * BM + tl.arange(0, BM)
    epilogue(acc, C, Out, b.to(tl.int64), ti, tj, rm, rn, scb, scm, scn, sob, som, son, alpha, beta, diag, HAS_C)
