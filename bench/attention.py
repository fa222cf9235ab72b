"""The TTT prefix attention alone, under flex_attention's kernel options.

Every TTT step runs ``flex_attention`` over the step-0 keys with the document-causal block mask and
its log-sum-exp (eagle3.train.attention, the ``flex`` backend): at the 8B draft's shape (32 query
heads, 8 KV heads, head dim 128, 2048 tokens) seven such calls forward and seven backward per step.
This times one call, forward and forward + backward (the gradient through both the output and the
log-sum-exp, as the diagonals' merge takes it), for each named set of kernel options in
:data:`FLEX_OPTION_SETS`, against the default, with each set's largest difference from the default's
output and gradients (run it with --docs above 1 too: the train rows hold several documents).
(The same prefix on cuDNN's and FlashAttention-2's fused kernels was slower than flex and was
removed: bench/results/prefix_kernels_h200_202612.md.)

    python3 bench/attention.py                       # every set, one document per row
    python3 bench/attention.py --docs 4 --sets default,safe

Prints a table; no hydra needed.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.optimizer import Timer  # noqa: E402
from eagle3.train.attention import TTTMask  # noqa: E402

FLEX_OPTION_SETS = {
    "default": {},
    # The two guarantees below hold for one document per row only. On one H200 they made a call
    # 0.93-1.00 ms against 1.20-1.26 with the defaults there; on rows of three documents they gave
    # NaN (ROWS_GUARANTEED_SAFE: a query's first key blocks can all be another document's) or wrong
    # outputs (BLOCKS_ARE_CONTIGUOUS: a document that starts inside a block leaves its two partial key
    # blocks apart): bench/results/step_levers_h200_202612.md. Train rows hold several documents
    # (packing, or a sample and its padding), so eagle3 uses neither.
    "rows_safe": {"ROWS_GUARANTEED_SAFE": True},
    "contiguous": {"BLOCKS_ARE_CONTIGUOUS": True},
    "safe": {"ROWS_GUARANTEED_SAFE": True, "BLOCKS_ARE_CONTIGUOUS": True},
    "tma": {"USE_TMA": True},
    "safe_tma": {"ROWS_GUARANTEED_SAFE": True, "BLOCKS_ARE_CONTIGUOUS": True, "USE_TMA": True},
    "fwd128": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_warps": 8, "fwd_num_stages": 2},
    "bwd64_128": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 64,
                  "bwd_num_warps": 8, "bwd_num_stages": 3},
    "bwd64_64w4": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
                   "bwd_num_warps": 4, "bwd_num_stages": 3},
    "bwd32_128": {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 32,
                  "bwd_num_warps": 4, "bwd_num_stages": 3},
    "prescale": {"PRESCALE_QK": True},
}
"""Named flex_attention kernel options (torch's FlexKernelOptions) for the prefix attention."""


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--docs", type=int, default=1, help="documents per row (packed rows: the mask's document part)")
    p.add_argument("--sets", default=",".join(FLEX_OPTION_SETS))
    p.add_argument("--layout", choices=("draft", "heads"), default="draft",
                   help="q, k, v in memory as the draft makes them ([B, T, H, D]) or head-major ([B, H, T, D], "
                        "what the runs before December 2026 used)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench/attention.py times GPU kernels; no CUDA device is visible")
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    dev = torch.device("cuda")
    timer = Timer(dev)  # median ms of CUDA events around each call
    gen = torch.Generator(device=dev).manual_seed(0)
    B, H, Hk, T, D = a.batch, a.heads, a.kv_heads, a.seq, a.head_dim
    doc = (torch.arange(T, device=dev) // (T // a.docs)).clamp(max=a.docs - 1).expand(B, T).contiguous()
    mask = TTTMask(doc, 1, "flex").prefix_block()

    def make(h):  # [B, h, T, D], laid out in memory as --layout says
        if a.layout == "draft":
            return torch.randn(B, T, h, D, generator=gen, device=dev).bfloat16().transpose(1, 2)
        return torch.randn(B, h, T, D, generator=gen, device=dev).bfloat16()
    q, k, v = (make(h).requires_grad_() for h in (H, Hk, Hk))
    go = make(H)
    gl = torch.randn(B, H, T, generator=gen, device=dev)
    # causal FLOPs of one call: QK^T and PV over the visible half, forward; backward 2.5x that
    visible = float(mask.to_dense().sum()) * 128 * 128 / (T * T) if hasattr(mask, "to_dense") else 0.5
    fwd_flop = 4 * B * H * T * T * D * min(1.0, visible)
    rows, ref = [], None
    for name in [s for s in a.sets.split(",") if s]:
        torch._dynamo.reset()
        opts = FLEX_OPTION_SETS[name]

        def call(q, k, v, opts=opts):
            out, aux = flex_attention(q, k, v, block_mask=mask, scale=D ** -0.5, enable_gqa=H != Hk,
                                      return_aux=AuxRequest(lse=True), kernel_options=dict(opts) or None)
            return out, aux.lse
        # compiled, as the train loop's TTT graph has it
        fn = torch.compile(call, dynamic=False)
        row = {"set": name, "options": opts}
        try:
            def fwd(fn=fn):
                with torch.no_grad():
                    return fn(q, k, v)

            def fwd_bwd(fn=fn):
                out, lse = fn(q, k, v)
                return torch.autograd.grad((out, lse), (q, k, v), (go, gl))
            out, lse = fwd()
            grads = fwd_bwd()
            row["fwd_ms"] = timer(fwd, a.warmup, a.steps)
            row["fwd_bwd_ms"] = timer(fwd_bwd, a.warmup, a.steps)
            row["bwd_ms"] = row["fwd_bwd_ms"] - row["fwd_ms"]
            row["fwd_tflops"] = fwd_flop / row["fwd_ms"] / 1e9
            row["bwd_tflops"] = 2.5 * fwd_flop / row["bwd_ms"] / 1e9
            got = [out, lse, *grads]
            if ref is None:
                ref = [t.float() for t in got]
            row["max_diff"] = {n: (g.float() - r).abs().max().item() / max(r.abs().max().item(), 1e-12)
                               for n, g, r in zip(("out", "lse", "dq", "dk", "dv"), got, ref)}
        except Exception as e:  # noqa: BLE001 - a set that does not build here is a row, not the end
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}: TTT prefix attention, B {B}, heads {H}/{Hk}, "
          f"head dim {D}, {T} tokens, {a.docs} document(s) per row, {a.layout} layout; one call, median of {a.steps}")
    print(f"{'set':<14}{'fwd ms':>9}{'bwd ms':>9}{'fwd+bwd':>9}{'fwd TF/s':>10}{'bwd TF/s':>10}"
          f"{'max rel diff vs the first set (out lse dq dk dv)':>52}")
    for r in rows:
        if "error" in r:
            print(f"{r['set']:<14} failed: {r['error'][:120]}")
            continue
        d = " ".join(f"{x:.1e}" for x in r["max_diff"].values())
        print(f"{r['set']:<14}{r['fwd_ms']:>9.3f}{r['bwd_ms']:>9.3f}{r['fwd_bwd_ms']:>9.3f}{r['fwd_tflops']:>10.0f}"
              f"{r['bwd_tflops']:>10.0f}{d:>52}")


if __name__ == "__main__":
    main()
