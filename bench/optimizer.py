"""CPU cost of ``train.optimizer=muon`` against AdamW: one train step (target head, TTT forward and
backward, clipping, the optimizer step) and the optimizer step alone, float32, at a tiny shape.

    python bench/optimizer.py                            # H 256, MLP 768, vocab 4096->1024, TTT 3, 1x256
    python bench/optimizer.py --hidden 512 --intermediate 1536 --seq 512

The step is bench/train.py's ``train_step`` (what the train loop runs), with the optimizer the loop
builds (eagle3.train.optim.build_optimizer): fused AdamW with the clip folded into it, or Muon on the
2-D weights of the hidden path + fused AdamW on lm_head and the norms (clip_grad_norm_ then, as the
loop does for anything but fused AdamW alone). Times: median over ``--steps`` after ``--warmup``.
Findings: bench/results/train_h200_202611.md ("Muon on CPU").
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.train import add_shape_args, describe_shape, make_batch, make_config, make_head, train_step  # noqa: E402
from eagle3.config import TrainConfig  # noqa: E402
from eagle3.model.draft import Eagle3Draft  # noqa: E402
from eagle3.train.optim import build_optimizer  # noqa: E402
from eagle3.train.ttt import TTTModel  # noqa: E402


def run(a, optimizer: str) -> dict:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    cfg = make_config(a)
    cpu = torch.device("cpu")
    model = TTTModel(Eagle3Draft(cfg), num_steps=a.ttt, attention="sdpa")
    head, _ = make_head(cfg, cpu, torch.float32, gen)
    opt = build_optimizer(model, TrainConfig(optimizer=optimizer), cpu)
    batches = [make_batch(cfg, a.batch, a.seq, cpu, torch.float32, gen) for _ in range(2)]
    step_s, opt_s = [], []
    for i in range(a.warmup + a.steps):  # the loop's step: clip folded into fused AdamW, else clip_grad_norm_
        t0 = time.perf_counter()
        train_step(model, head, batches[i % 2], opt, torch.float32, False, 0.5)
        if i >= a.warmup:
            step_s.append(time.perf_counter() - t0)
    train_step(model, head, batches[0], None, torch.float32, False, 0.5)  # gradients, kept for the steps below
    for i in range(a.warmup + a.steps):  # the optimizer step alone
        t0 = time.perf_counter()
        opt.step()
        if i >= a.warmup:
            opt_s.append(time.perf_counter() - t0)
    return {"optimizer": optimizer, "step_ms": 1e3 * statistics.median(step_s),
            "opt_ms": 1e3 * statistics.median(opt_s)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(p)
    p.set_defaults(hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=768, vocab=4096, draft_vocab=1024,
                   ttt=3, seq=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    a = p.parse_args(argv)
    rows = [run(a, o) for o in ("adamw", "muon")]
    print(f"CPU ({torch.get_num_threads()} threads), torch {torch.__version__}: {describe_shape(a)} tokens, float32")
    print(f"{'optimizer':<10}{'step ms':>10}{'optimizer ms':>14}{'step vs adamw':>15}")
    for r in rows:
        print(f"{r['optimizer']:<10}{r['step_ms']:>10.1f}{r['opt_ms']:>14.2f}"
              f"{r['step_ms'] / rows[0]['step_ms'] - 1:>+15.1%}")


if __name__ == "__main__":
    main()
