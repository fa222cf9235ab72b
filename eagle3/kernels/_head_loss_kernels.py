"""The Triton kernel of :mod:`eagle3.kernels.head_loss` (imported only where Triton is: see its docstring)."""
import triton
import triton.language as tl


@triton.jit
def soft_ce_kernel(L, T, Rows, W, CE, Arg, V, stride_l, stride_t, BLOCK: tl.constexpr):
    """One program per row n of the logits L [N, V]: its target row is T[Rows[n]], its weight W[n].
    Writes CE[n] = logsumexp(x) * sum(p) - <p, x> and Arg[n] = argmax(x) (the first of equal maxima),
    and overwrites the row of L with W[n] * (softmax(x) * sum(p) - p), the gradient of W[n] * CE[n].
    Two passes over chunks of BLOCK: the first for the row's sums (an online log-sum-exp), the second
    reads the row again for the gradient. (The whole row in registers, read once, was slower:
    bench/results/head_loss_h200_202612.md.)"""
    n = tl.program_id(0).to(tl.int64)
    row_t = tl.load(Rows + n).to(tl.int64)
    w = tl.load(W + n).to(tl.float32)
    lp = L + n * stride_l
    tp = T + row_t * stride_t
    offs = tl.arange(0, BLOCK)
    mask = offs < V
    x = tl.load(lp + offs, mask=mask, other=float("-inf")).to(tl.float32)
    p = tl.load(tp + offs, mask=mask, other=0.0).to(tl.float32)
    m, arg = tl.max(x, 0, return_indices=True)
    s = tl.sum(tl.exp(x - m), 0)
    ps = tl.sum(p, 0)
    px = tl.sum(tl.where(mask, p * x, 0.0), 0)
    best = m
    for start in range(BLOCK, V, BLOCK):
        cols = start + offs
        mask = cols < V
        x = tl.load(lp + cols, mask=mask, other=float("-inf")).to(tl.float32)
        p = tl.load(tp + cols, mask=mask, other=0.0).to(tl.float32)
        cmax, cidx = tl.max(x, 0, return_indices=True)
        new_m = tl.maximum(m, cmax)
        s = s * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), 0)
        m = new_m
        ps += tl.sum(p, 0)
        px += tl.sum(tl.where(mask, p * x, 0.0), 0)
        arg = tl.where(cmax > best, start + cidx, arg)
        best = tl.maximum(best, cmax)
    lse = m + tl.log(s)
    tl.store(CE + n, lse * ps - px)
    tl.store(Arg + n, arg.to(tl.int64))
    for start in range(0, V, BLOCK):
        cols = start + offs
        mask = cols < V
        x = tl.load(lp + cols, mask=mask, other=0.0).to(tl.float32)
        p = tl.load(tp + cols, mask=mask, other=0.0).to(tl.float32)
        g = w * (tl.exp(x - lse) * ps - p)
        tl.store(lp + cols, g.to(L.dtype.element_ty), mask=mask)
