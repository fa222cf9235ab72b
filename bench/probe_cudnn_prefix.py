"""cuDNN's fused attention as the TTT prefix's kernel, alone: its forward and backward calls at the
8B draft's shape (1 x 2048 tokens, 32 query / 8 KV heads, head dim 128, causal, bf16), K/V repeated
to the query heads and everything in the draft's [B, T, H, D] memory layout, the backward handed the
output folded with the log-sum-exp's gradient (eagle3.train.prefix_kernels.fold_lse_grad). Checks
out, lse and the gradients against a float32 reference through both, and times the calls (median
of 30 after 5); the backward once for each form of its always-required bias (a broadcast zero, a
[1, 1, T, T] zero, an expanded zero). Then whether cuDNN's variable-length (ragged) form runs, and
FlashAttention-2's dense forward for comparison.

    python3 bench/probe_cudnn_prefix.py

bench/results/prefix_kernels_h200_202612.md has its one run. The ``cudnn`` set of bench/attention.py
times the same calls ("its kernels") beside the whole compiled prefix.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.optimizer import Timer  # noqa: E402
from eagle3.train.prefix_kernels import fold_lse_grad  # noqa: E402


def timeit(fn):
    """Median ms of 30 calls after 5 (bench/optimizer.py's Timer: CUDA events around each)."""
    return Timer(torch.device("cuda"))(fn, 5, 30)


def main():
    if not torch.cuda.is_available():
        sys.exit("bench/probe_cudnn_prefix.py times GPU kernels; no CUDA device is visible")
    dev, B, H, Hk, T, D = "cuda", 1, 32, 8, 2048, 128
    g, sc = H // Hk, D ** -0.5
    torch.manual_seed(0)
    q, k, v, go = (torch.randn(B, T, h, D, device=dev, dtype=torch.bfloat16) for h in (H, Hk, Hk, H))
    gl = torch.randn(B, H, T, device=dev)

    # float32 reference through (out, lse)
    qr, kr, vr = (x.float().transpose(1, 2).requires_grad_() for x in (q, k, v))
    s = qr @ kr.repeat_interleave(g, 1).transpose(-1, -2) * sc
    s = s.masked_fill(~torch.ones(T, T, device=dev, dtype=torch.bool).tril(), float("-inf"))
    lse_r, out_r = torch.logsumexp(s, -1), torch.softmax(s, -1) @ vr.repeat_interleave(g, 1)
    ref = [out_r, lse_r, *torch.autograd.grad((out_r, lse_r), (qr, kr, vr), (go.float().transpose(1, 2), gl))]
    del s

    def rel(a, r):
        return ((a.float() - r).abs().max() / r.abs().max()).item()

    # [B, H, T, D] views of [B, T, H, D] memory
    qd, god = q.transpose(1, 2), go.transpose(1, 2)
    kd, vd = (x.repeat_interleave(g, 2).transpose(1, 2) for x in (k, v))

    def f():
        return torch.ops.aten._scaled_dot_product_cudnn_attention(qd, kd, vd, None, True, 0.0, True, False, scale=sc)
    res = f()
    out, lse = res[0], res[1]
    print("dense cudnn out", tuple(out.shape), out.stride(), "lse", tuple(lse.shape), lse.stride())
    folded = fold_lse_grad(out, god, gl)
    print(f"dense cudnn fwd {timeit(f):.3f} ms")
    for name, bias in (("b1111", torch.zeros(1, 1, 1, 1, device=dev, dtype=torch.bfloat16)),
                       ("b11TT", torch.zeros(1, 1, T, T, device=dev, dtype=torch.bfloat16)),
                       ("bexp", torch.zeros(1, 1, 1, 1, device=dev, dtype=torch.bfloat16).expand(B, H, T, T))):
        try:
            def bwd(bias=bias):
                # cum_seq_q/k as the dense forward returns them (undefined: None)
                return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                    god, qd, kd, vd, folded, lse, res[6], res[7], bias, res[2], res[3], res[4], res[5], 0.0, True,
                    scale=sc)
            dq, dk, dv = bwd()
            dk, dv = (x.view(B, Hk, g, T, D).sum(2) for x in (dk, dv))
            errs = [round(rel(a, r), 5) for a, r in zip((out, lse.reshape(B, H, T), dq, dk, dv), ref)]
            print(name, "dense cudnn rel err out lse dq dk dv:", errs, f"bwd {timeit(bwd):.3f} ms")
        except Exception as e:  # noqa: BLE001 - a form the kernel refuses is a line, not the end
            print(name, "failed", str(e)[:300])
    cu = torch.tensor([0, T], device=dev, dtype=torch.int32)

    def ragged():
        return torch.ops.aten._cudnn_attention_forward(q[0], k[0], v[0], None, cu, cu, T, T, True, 0.0, True, False,
                                                       scale=sc)
    try:
        r = ragged()
        print("ragged cudnn (GQA) out", tuple(r[0].shape), "lse", tuple(r[1].shape),
              f"rel out {rel(r[0].transpose(0, 1)[None], ref[0]):.5f}", f"fwd {timeit(ragged):.3f} ms")
    except Exception as e:  # noqa: BLE001
        print("ragged cudnn failed", str(e)[:300])

    def fa2():
        return torch.ops.aten._scaled_dot_product_flash_attention(qd, k.transpose(1, 2), v.transpose(1, 2), 0.0, True,
                                                                  False, scale=sc)
    print(f"FlashAttention-2 dense fwd {timeit(fa2):.3f} ms")
    print("cudnn version", torch.backends.cudnn.version())


if __name__ == "__main__":
    main()
