"""Where a traced step's GPU time goes, per kernel: a chrome trace from ``bench/train.py --loop-trace N``
(``$OUT/loop_trace_*.json.gz``) summed by kernel name and by class, per traced step.

    python3 bench/trace_kernels.py loop_trace_auto_f8mm.json.gz [--top 30]

Classes: float8 GEMMs (cuBLAS's nvjet ``qq`` kernels with outer-vector scales), the compiled
kernels that quantize for them (Triton kernels computing an amax), other GEMMs (bf16), flex
attention, the fused head loss, other compiled Triton kernels (reductions, pointwise), copies. Prints a table per
file; with --json writes the same next to each file.
"""
from __future__ import annotations

import argparse
import gzip
import json
import re
from collections import defaultdict
from pathlib import Path

CLASSES = [  # first match wins
    ("float8 GEMM", re.compile(r"^nvjet_\w*qq|ovscale|f8f8|e4m3.*gemm|gemm.*e4m3", re.I)),
    ("float8 quantization (Triton)", re.compile(r"^triton_\w*(amax|_scaled_mm)", re.I)),
    ("flex attention", re.compile(r"flex_attention|^triton_tem_fused", re.I)),
    ("head loss (Triton)", re.compile(r"soft_ce", re.I)),
    ("GEMM", re.compile(r"gemm|nvjet|cutlass|xmma|sm90_|sm100_|cublas", re.I)),
    ("Triton reduction", re.compile(r"^triton_(red|per)_", re.I)),
    ("Triton pointwise", re.compile(r"^triton_poi_", re.I)),
    ("Triton other", re.compile(r"^triton_", re.I)),
    ("copy / memset", re.compile(r"memcpy|memset|copy", re.I)),
]


def kernel_class(name: str) -> str:
    return next((c for c, rx in CLASSES if rx.search(name)), "other")


def summarise(path: Path, top: int) -> dict:
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    ev = [e for e in json.loads(raw)["traceEvents"] if e.get("ph") == "X"]
    # every kernel the traced steps launched (the profiler's window holds exactly those steps'
    # launches; their kernels run later than the host's step marks, so the marks cannot cut them)
    n = sum(1 for e in ev if e.get("name") == "bench.optimizer_step" and e.get("cat") == "user_annotation")
    gpu = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    span = (max(e["ts"] + e["dur"] for e in gpu) - min(e["ts"] for e in gpu)) / n / 1e3
    by_name, by_class = defaultdict(lambda: [0.0, 0]), defaultdict(float)
    for e in gpu:
        by_name[e["name"]][0] += e["dur"] / n / 1e3
        by_name[e["name"]][1] += 1
        by_class[kernel_class(e["name"])] += e["dur"] / n / 1e3
    names = sorted(by_name.items(), key=lambda kv: -kv[1][0])
    return {"file": path.name, "steps": n, "span_ms": span,
            "classes": dict(sorted(by_class.items(), key=lambda kv: -kv[1])),
            "kernels": [{"name": k[:120], "class": kernel_class(k), "ms": v[0], "launches": v[1] / n}
                        for k, v in names[:top]]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", type=Path)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--json", action="store_true", help="write NAME.kernels.json beside each trace")
    a = p.parse_args()
    for path in a.traces:
        s = summarise(path, a.top)
        print(f"\n{s['file']}: {s['steps']} steps; first kernel to last, per step: {s['span_ms']:.2f} ms")
        print("| class | ms a step |\n| --- | --- |")
        for c, ms in s["classes"].items():
            print(f"| {c} | {ms:.2f} |")
        print(f"| all kernels | {sum(s['classes'].values()):.2f} |")
        print("\n| kernel | class | ms a step | launches a step |\n| --- | --- | --- | --- |")
        for k in s["kernels"]:
            print(f"| `{k['name'][:90]}` | {k['class']} | {k['ms']:.3f} | {k['launches']:.0f} |")
        if a.json:
            path.with_name(path.name.split(".")[0] + ".kernels.json").write_text(json.dumps(s, indent=1))


if __name__ == "__main__":
    main()
