"""Prepare-stage throughput on single-turn chat data, through the real stage (CLI config path).

    python bench/prepare.py                      # SmolLM2 default target, 20k conversations
    python bench/prepare.py --target /models/x --n 50000
    python bench/prepare.py --regen hf,vllm --n 1024      # response regeneration, per backend

Prints a table: conversations, tokens, whole-stage seconds and tokens/s (read + dedup + mask +
split + vocab + write), and the tokenization-only rate the stage records in stats.json.
Raw numbers go to $OUT/prepare_bench.json when OUT is set.

``--regen BACKENDS``: the prepare stage's regeneration (eagle3.data.regenerate, the
``experiment=smollm2_large`` settings: bf16, greedy, up to 384 new tokens, transformers in batches of
``prepare.regen.hf_batch_size``) over the first N conversations of that preset's data, once per
backend, on the same machine: wall seconds with the model load, seconds in generate calls, generated
tokens/s, and how many answers equal the first backend's (greedy bf16 on two engines can part at a
near-tie). Writes $OUT/regen_bench.json.
"""
from __future__ import annotations

import argparse
import dataclasses
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
    ap.add_argument("--regen", default="", help="comma-separated regeneration backends to time (hf, vllm)")
    ap.add_argument("--max-tokens", type=int, default=0, help="--regen: new tokens per answer (default: the preset's)")
    ap.add_argument("--kv-cache-gb", type=float, default=0, help="--regen: vLLM's KV cache (default: the preset's)")
    ap.add_argument("--gguf", default="", help="--regen: the target as a GGUF file (default: the packaged SmolLM2)")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    if args.regen:
        return regen_bench(args)
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


def regen_bench(args) -> None:
    from collections import Counter

    from eagle3.__main__ import compose_config
    from eagle3.data import regenerate as rg
    from eagle3.data.dataset import load_conversations
    from eagle3.data.sources import ReadReport
    from eagle3.target import load_tokenizer, resolve

    ws = Path(args.workspace or tempfile.mkdtemp(prefix="eagle3-bench-"))
    overrides = [f"workspace={ws}", "experiment=smollm2_large", f"data.max_samples={args.n}", "progress=false"]
    if args.target:
        overrides.append(f"target.path={args.target}")
    elif args.gguf:
        overrides.append(f"target.gguf={args.gguf}")
    cfg = compose_config(overrides)
    target = resolve(cfg.target, cfg.workspace)  # a GGUF is converted once, before any timing
    tokenizer = load_tokenizer(target, cfg.target.chat_template)
    conversations = load_conversations(cfg, ReadReport(), Counter())
    in_generate = {"s": 0.0}

    def timed(method):
        def wrapper(self, prompts):
            t = time.perf_counter()
            try:
                return method(self, prompts)
            finally:
                in_generate["s"] += time.perf_counter() - t
        return wrapper

    for cls in (rg._VLLMGenerator, rg._HFGenerator):
        cls.generate = timed(cls.generate)
    rows, answers = [], {}
    for backend in [b.strip() for b in args.regen.split(",") if b.strip()]:
        regen_cfg = dataclasses.replace(cfg.prepare.regen, backend=backend,
                                        max_tokens=args.max_tokens or cfg.prepare.regen.max_tokens,
                                        kv_cache_gb=args.kv_cache_gb or cfg.prepare.regen.kv_cache_gb)
        in_generate["s"] = 0.0
        t0 = time.perf_counter()
        out, stats = rg.regenerate(conversations, tokenizer, str(target.path), regen_cfg, progress=False,
                                   dtype=regen_cfg.dtype)
        wall = time.perf_counter() - t0
        texts = [[m["content"] for m in c if m["role"] == "assistant"] for c in out]
        answers[backend] = texts
        generated = sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for c in texts for t in c)
        rows.append({"backend": backend, "conversations": len(conversations), "turns": stats["regenerated_turns"],
                     "generated_tokens": generated, "wall_s": round(wall, 1),
                     "generate_s": round(in_generate["s"], 1),
                     "generated_tokens_per_s": round(generated / in_generate["s"]),
                     "hit_max_tokens": stats["truncated_turns"]})
        print(f"bench: {rows[-1]}", file=sys.stderr, flush=True)
    first = rows[0]["backend"]
    for row in rows:
        a, b = answers[first], answers[row["backend"]]
        same = sum(x == y for ca, cb in zip(a, b) for x, y in zip(ca, cb))
        row["answers_equal_to_" + first] = f"{same}/{sum(len(c) for c in a)}"
        row["generate_speedup_vs_" + first] = round(rows[0]["generate_s"] / row["generate_s"], 2)
        row["wall_speedup_vs_" + first] = round(rows[0]["wall_s"] / row["wall_s"], 2)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "regen_bench.json").write_text(json.dumps(rows, indent=2))
    print()
    print(f"regeneration, experiment=smollm2_large settings ({regen_cfg.dtype}, temperature "
          f"{regen_cfg.temperature}, max_tokens {regen_cfg.max_tokens}), {len(conversations)} conversations")
    print()
    print("| " + " | ".join(rows[0]) + " |")
    print("|" + "---|" * len(rows[0]))
    for row in rows:
        print("| " + " | ".join(str(v) for v in row.values()) + " |")


if __name__ == "__main__":
    main()
