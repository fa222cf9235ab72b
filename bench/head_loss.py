"""The draft head and its loss alone: unfused (torch code compiled by Inductor, what
``train.head_loss=unfused`` runs) against the fused op (``eagle3::head_soft_ce``, the default on CUDA).

At the 8B draft's shape (TTT 7 x 2048 rows, hidden 4096, draft vocabulary 32000, bf16): the rows'
final norm, the lm_head matmul, the soft cross-entropy against shifted windows of one row of targets,
the argmax, and the backward into the rows and the weight. Times forward and forward + backward (the
median of --steps calls, CUDA events), the peak memory above the inputs, and each arm's largest
difference from a float32 reference of the same computation (loss, dx, dw relative to their largest
entry, and the share of rows whose argmax differs); then the fused op's kernel alone under a few
chunk sizes and warp counts (``eagle3.kernels.head_loss.CHUNK``, ``WARPS``).

    python3 bench/head_loss.py                      # the 8B shape
    python3 bench/head_loss.py --vocab 64000        # a larger draft vocabulary

Prints a table; writes $OUT/bench_head_loss.json when OUT is set. No hydra needed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import eagle3.kernels.head_loss as hl  # noqa: E402
from bench.optimizer import Timer  # noqa: E402
from eagle3.model.draft import rms_norm  # noqa: E402
from eagle3.train.loss import soft_cross_entropy_rows  # noqa: E402


def unfused(out, norm_w, w, target, tgt, weights):
    logits = torch.nn.functional.linear(rms_norm(out, norm_w, 1e-5), w)
    ce = soft_cross_entropy_rows(logits, target[tgt])
    return (ce * weights).sum(), ce, logits.detach().argmax(-1)


def fused(out, norm_w, w, target, tgt, weights):
    loss, ce, arg, _ = torch.ops.eagle3.head_soft_ce(rms_norm(out, norm_w, 1e-5), w, target, tgt, weights)
    return loss, ce, arg


def measure(fn, args, timer, steps: int):
    """(forward ms, forward + backward ms, peak GiB above what was allocated before) of fn(*args)."""
    out, norm_w, w, *rest = args
    o, ww = out.clone().requires_grad_(), w.clone().requires_grad_()

    def fwd():
        with torch.no_grad():
            fn(o, norm_w, ww, *rest)

    def fwd_bwd():
        o.grad = ww.grad = None
        fn(o, norm_w, ww, *rest)[0].backward()
    fwd_ms, step_ms = timer(fwd, 3, steps), timer(fwd_bwd, 3, steps)
    if o.device.type != "cuda":
        return fwd_ms, step_ms, float("nan")
    torch.cuda.synchronize()
    o.grad = ww.grad = None
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd()
    torch.cuda.synchronize()
    return fwd_ms, step_ms, (torch.cuda.max_memory_allocated() - base) / 2**30


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=7 * 2048, help="head rows (TTT steps x tokens)")
    p.add_argument("--ttt", type=int, default=7)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--device", default="cuda", help="cpu: a dry run of the script (the op's torch implementation)")
    a = p.parse_args()
    dev = torch.device(a.device)
    gen = torch.Generator(device=dev).manual_seed(0)
    N, H, V, S = a.rows, a.hidden, a.vocab, a.ttt
    T = N // S
    out = torch.randn(N, H, device=dev, generator=gen, dtype=torch.bfloat16)
    norm_w = torch.ones(H, device=dev, dtype=torch.bfloat16)
    w = (torch.randn(V, H, device=dev, generator=gen) * H ** -0.5).to(torch.bfloat16)
    # one row of targets per token (+ the steps' shift), read by every step through its window
    target = torch.softmax(torch.randn(T + S + 1, V, device=dev, generator=gen) * 3, -1).to(torch.bfloat16)
    j, t = torch.arange(N, device=dev) // T, torch.arange(N, device=dev) % T
    tgt = t + j + 1
    weights = torch.rand(N, device=dev, generator=gen) / N
    timer = Timer(dev)

    def grads(fn):
        o, ww = out.clone().requires_grad_(), w.clone().requires_grad_()
        loss, ce, arg = fn(o, norm_w, ww, target, tgt, weights)
        loss.backward()
        return loss.detach(), arg, o.grad, ww.grad

    ref = grads(lambda o, n, ww, *r: unfused(o.float(), n.float(), ww.float(), target.float(), *r[1:]))
    rows, results = [], []
    arms = [("unfused (compiled)", torch.compile(unfused, dynamic=False)),
            ("fused (compiled)", torch.compile(fused, dynamic=False))]
    for name, fn in arms:
        fwd_ms, step_ms, peak = measure(fn, (out, norm_w, w, target, tgt, weights), timer, a.steps)
        got = grads(fn)

        def rel(x, r):
            return float((x.float() - r.float()).abs().max() / r.float().abs().max())
        r = {"arm": name, "fwd_ms": fwd_ms, "fwd_bwd_ms": step_ms, "peak_gib": peak,
             "loss": rel(got[0], ref[0]), "argmax_differs": float((got[1] != ref[1]).float().mean()),
             "dx": rel(got[2], ref[2]), "dw": rel(got[3], ref[3])}
        print(json.dumps(r), flush=True)
        results.append(r)
        rows.append(f"{name:28s} {fwd_ms:8.3f} {step_ms:9.3f} {peak:8.2f}   {r['loss']:.1e} {r['dx']:.1e} "
                    f"{r['dw']:.1e} {r['argmax_differs']:.4f}")
    if dev.type == "cuda":  # the kernel alone, per configuration (it rewrites its input: timing only)
        buf = torch.nn.functional.linear(out, w)
        saved = hl.CHUNK, hl.WARPS
        for chunk, warps in [(4096, 8), (2048, 4), (8192, 16), (4096, 4), (2048, 8)]:
            hl.CHUNK, hl.WARPS = chunk, warps
            ms = timer(lambda: hl._soft_ce_triton(buf, target, tgt, weights), 3, a.steps)
            name = f"kernel: chunk {chunk}, {warps} warps" + (" (eagle3's)" if (chunk, warps) == saved else "")
            results.append({"arm": name, "kernel_ms": ms, "gb_per_s": 3 * N * V * 2 / ms / 1e6})
            print(json.dumps(results[-1]), flush=True)
            rows.append(f"{name:28s} {ms:8.3f}  ({3 * N * V * 2 / ms / 1e6:.0f} GB/s for the logits read, the targets "
                        "read, the gradient written)")
        hl.CHUNK, hl.WARPS = saved
    print(f"\n{torch.cuda.get_device_name() if dev.type == 'cuda' else 'CPU'}, torch {torch.__version__}: draft head + soft CE, {N} rows, "
          f"hidden {H}, vocabulary {V}, bf16; median of {a.steps}")
    print(f"{'arm':28s} {'fwd ms':>8s} {'fwd+bwd':>9s} {'peak GiB':>8s}   loss / dx / dw rel. diff, argmax differs "
          "(vs float32)")
    print("\n".join(rows))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_head_loss.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
