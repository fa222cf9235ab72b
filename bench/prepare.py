"""Prepare-stage throughput on single-turn chat data, through the real stage (CLI config path).

    python bench/prepare.py                      # SmolLM2 default target, 20k conversations
    python bench/prepare.py --target /models/x --n 50000

Prints a table: conversations, tokens, whole-stage seconds and tokens/s (read + dedup + mask +
split + vocab + write), and the tokenization-only rate the stage records in stats.json.
Raw numbers go to $OUT/prepare_bench.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

TOPICS = ["a Python function that reverses a list", "why the sky is blue", "a haiku about autumn",
          "the difference between TCP and UDP", "how to compute a median", "a polite meeting reminder",
          "what a hash map is", "the causes of the French revolution", "how vaccines work",
          "a SQL query counting rows per day"]


def make_data(path: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    words = ("the of and to in is for that with as on it this by be are from or at an was which "
             "function value list return data model time system first number code result").split()
    with open(path, "w") as f:
        for i in range(n):
            q = f"Please explain {rng.choice(TOPICS)} (case {i})."
            a = " ".join(rng.choice(words) for _ in range(rng.randint(60, 260)))
            f.write(json.dumps({"messages": [{"role": "user", "content": q},
                                             {"role": "assistant", "content": a}]}) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="", help="HF model dir (default: the packaged SmolLM2)")
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--workspace", default="")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from eagle3.__main__ import compose_config
    from eagle3.manifest import Manifest
    from eagle3.runner import run
    from eagle3.target import resolve

    ws = Path(args.workspace or tempfile.mkdtemp(prefix="eagle3-bench-"))
    data = ws / "bench_chats.jsonl"
    ws.mkdir(parents=True, exist_ok=True)
    make_data(data, args.n)
    overrides = [f"workspace={ws}", "experiment=bench_prepare", f"data.path={data}", "stage=prepare",
                 "progress=false", "prepare.max_length=4096"]
    if args.target:
        overrides.append(f"target.path={args.target}")
    cfg = compose_config(overrides)
    resolve(cfg.target, cfg.workspace)  # convert the default GGUF target first: not part of prepare
    t0 = time.perf_counter()
    run(cfg)
    wall = time.perf_counter() - t0
    rec = Manifest(ws / "bench_prepare").current("prepare")
    stats = json.loads(rec.path("stats.json").read_text())
    row = {"conversations": stats["samples"], "tokens": stats["tokens"], "stage_seconds": round(wall, 2),
           "stage_tokens_per_s": round(stats["tokens"] / wall), "tokenize_tokens_per_s": stats["tokens_per_second"],
           "cores": os.cpu_count()}
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "prepare_bench.json").write_text(json.dumps(row, indent=2))
    print()
    print("| " + " | ".join(row) + " |")
    print("|" + "---|" * len(row))
    print("| " + " | ".join(str(v) for v in row.values()) + " |")


if __name__ == "__main__":
    main()
