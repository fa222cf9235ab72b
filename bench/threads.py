"""Does the thread probe (eagle3/cpu.py, ``cpu_threads=0``) pick the fastest count for the real work?

For each machine load (``--loads``: number of busy processes started beside the benchmark, each a
Python loop that never sleeps, standing for other jobs on a shared machine), it runs the probe for
both kinds of work and then times the real work at every candidate thread count:

- ``batch``: training steps of the embedded default's draft (SmolLM2-135M shape: H 576, 9/3 heads,
  MLP 1536, vocabulary 49152 -> 4096, TTT 3, 512-token rows, bf16 autocast where the CPU has native
  bf16), as the train stage runs them (bench/train.py's step): tokens/s.
- ``decode``: greedy decoding with a random SmolLM2-shaped target (30 layers) through transformers,
  8 prompts x 32 new tokens (the offline evaluator's kind of work): tokens/s.

    python bench/threads.py                    # loads 0 and <cores>
    python bench/threads.py --loads 0,1,2,4 --steps 6

Prints a table: load, kind, the probe's pick (and its workloads/s per count), the real work's rate
at each count, and whether the pick was within 5% of the fastest. Run it on an otherwise idle
machine: load 0 must mean idle.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from eagle3.cpu import available_cores, candidates, native_bf16, probe_threads  # noqa: E402


def _spin():  # a busy process: another job on the machine
    x = 0
    while True:
        x += 1


def train_rate(threads: int, steps: int) -> float:
    from types import SimpleNamespace

    from train import make_batch, make_config, make_head, train_step

    from eagle3.train.ttt import TTTModel

    torch._C.set_num_threads(threads)
    a = SimpleNamespace(hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536, vocab=49152,
                        draft_vocab=4096, n_aux=3)
    cfg = make_config(a)
    gen = torch.Generator().manual_seed(0)
    bf16 = native_bf16()
    head, _ = make_head(cfg, "cpu", torch.bfloat16 if bf16 else torch.float32, gen)
    from eagle3.model.draft import Eagle3Draft

    torch.manual_seed(0)
    model = TTTModel(Eagle3Draft(cfg), num_steps=3, decay=0.8, attention="sdpa", compile=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = make_batch(cfg, 1, 512, "cpu", torch.float32, gen, docs=4)
    train_step(model, head, batch, opt, torch.float32, bf16, 1.0, fold=False)  # warm-up
    t0 = time.perf_counter()
    for _ in range(steps):
        train_step(model, head, batch, opt, torch.float32, bf16, 1.0, fold=False)
    return steps * 512 / (time.perf_counter() - t0)


def decode_rate(threads: int, new_tokens: int) -> float:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch._C.set_num_threads(threads)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 49152, (8, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, do_sample=False, min_new_tokens=2, pad_token_id=0)  # warm-up
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return 8 * new_tokens / (time.perf_counter() - t0)


def main(argv=None):
    cores = available_cores()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--loads", default=f"0,{cores}", help="busy processes beside the benchmark, comma-separated")
    p.add_argument("--steps", type=int, default=4, help="timed training steps per count")
    p.add_argument("--new-tokens", type=int, default=32, help="decoded tokens per prompt per count")
    a = p.parse_args(argv)
    rows = []
    for load in [int(x) for x in a.loads.split(",") if x]:
        spinners = [mp.Process(target=_spin, daemon=True) for _ in range(load)]
        for s in spinners:
            s.start()
        try:
            time.sleep(0.5 if load else 0)
            for kind, real in (("batch", lambda n: train_rate(n, a.steps)),
                               ("decode", lambda n: decode_rate(n, a.new_tokens))):
                pick, probe = probe_threads(kind)
                rates = {n: real(n) for n in candidates(cores)}
                best = max(rates.values())
                rows.append((load, kind, pick, probe, rates, rates[pick] >= 0.95 * best))
                print(f"load {load} {kind}: probe picks {pick} ({probe}), real {rates}", file=sys.stderr, flush=True)
        finally:
            for s in spinners:
                s.kill()
    counts = candidates(cores)
    print(f"\nthread probe vs real work on {cores} cores ({os.uname().machine}, native bf16: {native_bf16()}); "
          f"batch = draft training tokens/s, decode = greedy decoding tokens/s")
    print("| busy processes | work | probe picks | probe workloads/s by threads | "
          + " | ".join(f"real, {n} thr" for n in counts) + " | pick within 5% of fastest |")
    print("| --- | --- | --- | --- | " + " | ".join("---" for _ in counts) + " | --- |")
    for load, kind, pick, probe, rates, ok in rows:
        print(f"| {load} | {kind} | {pick} | " + ", ".join(f"{n}: {r:.0f}" for n, r in probe.items()) + " | "
              + " | ".join(f"{rates[n]:.0f}" for n in counts) + f" | {'yes' if ok else 'NO'} |")


if __name__ == "__main__":
    main()
