"""Benchmark of the EAGLE-3 train loop (eagle3.train.loop.train, what ``stage=train`` runs) on a GPU.

Random inputs of a configurable shape; default a Llama-3.1-8B-shaped draft (H 4096, 32 heads,
8 KV heads, MLP 14336, vocab 128256, draft vocab 32000, TTT 7, 2048 tokens, batch 1, bf16), fed
from an in-memory store (no disk I/O). One row per ``--loop`` run, each a train.compile value with
options: ``+muon`` (train.optimizer=muon), ``+fp8`` (the store's items in fp8), ``+f8mm`` /
``+f8mmw`` (train.fp8_matmul=on / bf16_wgrad).

    python bench/train.py --loop auto,auto+muon              # AdamW and Muon
    python bench/train.py --check --loop auto                # the GPU kernels against CPU float32 first
    python bench/train.py --loop auto,auto+f8mm --loop-samples 8 --loop-steps 60 --loop-trace 3
        # several epochs of 8 samples; 3 steps traced (GPU busy and idle, host time in and between
        # steps; the chrome trace to $OUT)

The helpers (shape, random draft, head and batch, one step) are shared with bench/train_dist.py,
bench/online.py and bench/peers/peer_step.py. Measurements: docs/benchmarks.md lists the results files.

Prints a table last; writes raw numbers to $OUT/bench_train.json when OUT is set. No hydra needed.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from eagle3.config import TrainConfig  # noqa: E402
from eagle3.model.draft import Eagle3Draft, Eagle3DraftConfig  # noqa: E402
from eagle3.train.optim import can_fold, fold_clip  # noqa: E402
from eagle3.train.source import HiddenStateSource  # noqa: E402
from eagle3.train.target_head import TargetHead, model_inputs  # noqa: E402
from eagle3.train.ttt import TTTModel  # noqa: E402


def make_config(a, vocab=None, draft_vocab=None) -> Eagle3DraftConfig:
    return Eagle3DraftConfig(hidden_size=a.hidden, target_hidden_size=a.hidden, num_attention_heads=a.heads,
                             num_key_value_heads=a.kv_heads, head_dim=a.head_dim, intermediate_size=a.intermediate,
                             rms_norm_eps=1e-5, vocab_size=vocab or a.vocab, draft_vocab_size=draft_vocab or a.draft_vocab,
                             aux_layer_ids=list(range(a.n_aux)), rope_theta=500000.0)


def make_head(cfg: Eagle3DraftConfig, device, dtype, gen) -> tuple:
    """(TargetHead, its tensors {'embed', 'norm', 'lm_head'} in target order)."""
    V, H = cfg.vocab_size, cfg.hidden_size
    embed = torch.randn(V, H, generator=gen, device=device).mul_(0.02).to(dtype)
    lm_head = torch.randn(V, H, generator=gen, device=device).mul_(0.02).to(dtype)
    norm = (1 + 0.1 * torch.randn(H, generator=gen, device=device)).to(dtype)
    kept = torch.randperm(V, generator=gen, device=device)[: cfg.draft_vocab_size].sort().values
    # larger kept rows: the target's argmax falls in the draft vocabulary at (nearly) every
    # position, as on real data, so every position is scored (worst case for the step time)
    lm_head[kept] *= 3
    return TargetHead(embed, norm, lm_head, cfg.rms_norm_eps, kept), {"embed": embed, "norm": norm, "lm_head": lm_head}


def make_batch(cfg, B, T, device, dtype, gen, docs=1) -> dict:
    H, n = cfg.hidden_size, cfg.num_aux_hidden_states
    doc_len = T // docs
    doc_ids = (torch.arange(T, device=device) // doc_len).clamp(max=docs - 1).expand(B, T).contiguous()
    pos = torch.arange(T, device=device) - doc_ids[0] * doc_len
    return {
        "input_ids": torch.randint(0, cfg.vocab_size, (B, T), generator=gen, device=device),
        "loss_mask": torch.ones(B, T, dtype=torch.long, device=device),
        "aux_hidden_states": torch.randn(B, T, n * H, generator=gen, device=device).to(dtype),
        "last_hidden_state": torch.randn(B, T, H, generator=gen, device=device).mul_(2).to(dtype),
        "position_ids": pos.expand(B, T).contiguous(),
        "doc_ids": doc_ids,
    }


def train_step(model, head, batch, opt, compute_dtype, autocast: bool, clip: float):
    """One step as the train loop runs it on one GPU: clipping folded into fused AdamW's kernel where
    it can be (eagle3/train/optim.py), else torch's clip_grad_norm_."""
    inputs = model_inputs(head, batch, compute_dtype)
    with torch.autocast(batch["loss_mask"].device.type, dtype=torch.bfloat16, enabled=autocast):
        loss, stats = model(**inputs)
    loss.backward()
    if opt is not None and can_fold(opt):
        gnorm = fold_clip(opt, model.parameters(), clip)
    else:
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    if opt is not None:
        opt.step()
        opt.zero_grad(set_to_none=True)
    return loss.detach(), stats, gnorm


CHECKS = [("gpu fp32 sdpa eager", ("sdpa", False, False)), ("gpu fp32 flex compiled", ("flex", True, False)),
          ("gpu fp32 flex_stacked compiled", ("flex_stacked", True, False)),
          ("gpu bf16 sdpa eager", ("sdpa", False, True)), ("gpu bf16 flex compiled", ("flex", True, True))]


class MemoryStore(HiddenStateSource):
    """``n`` samples cycling over a few ``items`` held in memory (no disk I/O)."""

    def __init__(self, items: list, n: int, layer_ids):
        self.items, self.lengths, self.layer_ids = items, np.full(n, len(items[0]["input_ids"])), tuple(layer_ids)

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return dict(self.items[i % len(self.items)], sample_index=i)


def random_items(a, dtype, fp8: bool = False, trainable: float = 1.0, k: int = 4) -> list:
    """``k`` random samples of ``a.seq`` tokens as a store's items, the first ``1 - trainable`` of
    each a prompt without loss; ``fp8``: as an fp8 store read raw gives them (float8 values + float32
    scales; the loop dequantises on the device). Seeded: every process builds the same."""
    from eagle3.fp8 import quantize

    gen = torch.Generator().manual_seed(1)
    prompt = round((1 - trainable) * a.seq)
    items = []
    for _ in range(k):
        it = {"input_ids": torch.randint(0, a.vocab, (a.seq,), generator=gen),
              "loss_mask": torch.arange(a.seq) >= prompt,
              "aux_hidden_states": torch.randn(a.seq, a.n_aux, a.hidden, generator=gen).to(dtype),
              "last_hidden_state": torch.randn(a.seq, a.hidden, generator=gen).mul_(2).to(dtype)}
        if fp8:
            it["aux_hidden_states"], it["aux_scales"] = quantize(it["aux_hidden_states"])
            it["last_hidden_state"], it["last_scales"] = quantize(it["last_hidden_state"])
        items.append(it)
    return items


def train_inputs(a, store, dtype=torch.bfloat16):
    """TrainInputs for eagle3.train.loop.train over ``store``: a draft of the bench shape (its aux
    layers the store's) and a random target head, seeded: every process builds the same."""
    from eagle3.train.loop import TrainInputs

    cfg = make_config(a)
    cfg.aux_layer_ids = list(store.layer_ids)
    head, tensors = make_head(cfg, "cpu", dtype, torch.Generator().manual_seed(0))
    kept = head.kept_ids
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool).index_fill_(0, kept, True)
    return TrainInputs(store, None, tensors, cfg.rms_norm_eps, kept - torch.arange(cfg.draft_vocab_size), t2d, cfg)


def loop_inputs(a, dtype=torch.bfloat16, fp8: bool = False):
    """TrainInputs over an in-memory store of ``a.loop_samples`` rows (default 64) cycling over 4
    random samples of the bench shape."""
    items = random_items(a, dtype, fp8, getattr(a, "loop_trainable", 1.0))
    # bench/train_dist.py's arguments have no --loop-samples
    return train_inputs(a, MemoryStore(items, getattr(a, "loop_samples", 64), range(a.n_aux)), dtype)


def loop_config(a, compile_mode: str, **overrides) -> TrainConfig:
    """The real TrainConfig with the bench's shape and step count (warmup 2, no evaluation or
    checkpoint inside the run, a logged window every 5 steps); ``overrides`` replace any field."""
    fields = dict(ttt_steps=a.ttt, warmup_steps=2, batch_size=a.batch, max_steps=a.loop_steps, max_seq_len=a.seq,
                  eval_every=10**6, save_every=10**6, keep_last=1, log_every=5, num_workers=2, compile=compile_mode)
    return TrainConfig(**{**fields, **overrides})


def loop_summary(name: str, recs: list, batch_tokens: int, wall: float) -> dict:
    """Throughput of a loop run from its metrics.jsonl records (tokens/s are global: all processes)."""
    steady = [r for r in recs if "train/loss" in r][1:]  # the first window holds the compilation
    tps = statistics.median(r["tokens_per_s"] for r in steady)
    return {"variant": name, "tokens_per_s": tps, "step_ms": batch_tokens / tps * 1e3,
            "peak_alloc_gib": max(r.get("peak_mem_gib", 0) for r in recs),
            "mfu": statistics.median(r.get("mfu", 0.0) for r in steady), "wall_s": wall,
            "windows": [(r["step"], r["tokens_per_s"], r["train/loss"]) for r in recs if "train/loss" in r]}


def run_loop(a, device, compile_mode: str) -> dict:
    """The train stage's own loop (eagle3.train.loop.train: Accelerate, data loader, packing,
    metrics) on an in-memory store of random samples of the bench shape (no disk I/O)."""
    import tempfile

    from eagle3.train.loop import train

    # "+fp8": the store's items as fp8 values + scales; "+muon": train.optimizer=muon; "+f8mm" /
    # "+f8mmw": train.fp8_matmul=on / bf16_wgrad (the layer's and fc's matmuls in float8)
    mode, *opts = compile_mode.split("+")
    unknown = set(opts) - {"fp8", "muon", "f8mm", "f8mmw"}
    if unknown:
        raise ValueError(f"unknown loop options {sorted(unknown)} in {compile_mode!r}: +fp8, +muon, +f8mm, +f8mmw")
    inputs = loop_inputs(a, fp8="fp8" in opts)
    tcfg = loop_config(a, mode, optimizer="muon" if "muon" in opts else "adamw",
                       fp8_matmul="on" if "f8mm" in opts else "bf16_wgrad" if "f8mmw" in opts else "off")
    # what earlier runs in this process left allocated (compiled code holds on to their models) is not
    # this run's: the peak is counted from a reset, less that base
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) / 2**30
    with tempfile.TemporaryDirectory() as out, loop_trace(a, compile_mode) as traced, \
            wall_clock(a.loop_steps) as clock:
        t0 = time.time()
        train(tcfg, inputs, Path(out), progress=False)
        wall = time.time() - t0
        recs = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    r = loop_summary(f"loop ({compile_mode})", recs, a.batch * a.seq, wall)
    r["peak_alloc_gib"] -= base
    r["base_alloc_gib"] = base
    r.update(clock)
    if traced:
        r["trace"] = traced
    return r


@contextlib.contextmanager
def wall_clock(steps: int, first: int = 10):
    """The loop's steps from ``first`` to the last on the host's clock, the device synchronised at
    both ends (once each): ``wall_step_ms``, a figure that does not depend on how the loop times its
    own windows. Yields a dict, filled when the loop has run."""
    import eagle3.train.loop as L

    real, calls, marks, result = L._optimizer_step, [0], {}, {}

    def step(*args, **kw):
        i = calls[0]
        calls[0] += 1
        if i == first:
            torch.cuda.synchronize()
            marks["start"] = time.perf_counter()
        out = real(*args, **kw)
        if i == steps - 1:
            torch.cuda.synchronize()
            marks["end"] = time.perf_counter()
        return out
    L._optimizer_step = step
    try:
        yield result
    finally:
        L._optimizer_step = real
    if "start" in marks and "end" in marks:
        result["wall_step_ms"] = (marks["end"] - marks["start"]) * 1e3 / (steps - first)


@contextlib.contextmanager
def loop_trace(a, compile_mode: str):
    """``--loop-trace N``: torch.profiler over N of the loop's optimizer steps (from the last ones but
    two, where the host is well ahead of the GPU if it can be), to see whether the loop is held by
    the GPU or by the host: per step the wall time, the GPU's busy time (the union of its kernels),
    the host's time inside ``_optimizer_step`` and outside it (the loop's own code between steps).
    Yields a dict, filled when the loop has run; writes the trace (gzip) to $OUT when set."""
    n = getattr(a, "loop_trace", 0)
    result: dict = {}
    if not n:
        yield result
        return
    import gzip
    import tempfile

    from torch.profiler import ProfilerActivity, profile, record_function

    import eagle3.train.loop as L

    real, calls = L._optimizer_step, [0]
    first = max(2, a.loop_steps - n - 2)
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])

    def step(*args, **kw):
        i = calls[0]
        calls[0] += 1
        if i == first:
            torch.cuda.synchronize()
            prof.start()
        if i == first + n:
            torch.cuda.synchronize()
            prof.stop()
        with record_function("bench.optimizer_step" if first <= i < first + n else "bench.untraced"):
            return real(*args, **kw)
    L._optimizer_step = step
    try:
        yield result
    finally:
        L._optimizer_step = real
    if calls[0] < first + n + 1:
        result["error"] = f"the loop ran {calls[0]} steps, fewer than the {first + n + 1} the trace needs"
        return
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        raw = Path(f"{tmp}/trace.json").read_bytes()
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], f"loop_trace_{compile_mode.replace('+', '_')}.json.gz").write_bytes(gzip.compress(raw))
    result.update(trace_summary(json.loads(raw)))
    print(f"loop trace ({compile_mode}, {n} steps): " + json.dumps(result), flush=True)


def trace_summary(trace: dict) -> dict:
    """Per-step means over a profiled window's steps (its ``bench.optimizer_step`` marks): the GPU's span (its first kernel's start
    to its last kernel's end: the GPU runs behind the host, so the host's step marks cannot cut its
    work into steps), GPU busy (the union of kernel/memcpy/memset intervals) and idle within that
    span, and the host's time in the step function and between steps (from its marks)."""
    ev = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    steps = sorted((e for e in ev if e.get("name") == "bench.optimizer_step" and e.get("cat") == "user_annotation"),
                   key=lambda e: e["ts"])
    gpu = sorted(((e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")))
    if len(steps) < 2 or not gpu:
        return {"error": f"{len(steps)} traced steps, {len(gpu)} GPU events"}
    busy, end = 0.0, gpu[0][0]
    for s, e in gpu:
        s = max(s, end)
        if e > s:
            busy += e - s
            end = e
    span = max(e for _, e in gpu) - gpu[0][0]
    inside = sum(e["dur"] for e in steps)
    host = steps[-1]["ts"] + steps[-1]["dur"] - steps[0]["ts"]
    per = len(steps)
    return {"steps": per, "gpu_span_ms": span / per / 1e3, "gpu_busy_ms": busy / per / 1e3,
            "gpu_idle_ms": (span - busy) / per / 1e3, "host_in_step_ms": inside / per / 1e3,
            "host_between_steps_ms": (host - inside) / max(1, per - 1) / 1e3}


def correctness_check(device, checks=CHECKS) -> list:
    """Small shape: loss, stats and gradients of every GPU variant against CPU float32 (sdpa,
    eager: the path the CPU tests prove equal to the naive per-step reference)."""
    class A:
        pass
    a = A()
    a.hidden, a.heads, a.kv_heads, a.head_dim, a.intermediate, a.n_aux = 256, 4, 2, 64, 512, 3
    cfg = make_config(a, vocab=1000, draft_vocab=300)
    gen = torch.Generator(device="cpu").manual_seed(1)
    head_cpu, tensors = make_head(cfg, "cpu", torch.float32, gen)
    batch_cpu = make_batch(cfg, 2, 200, "cpu", torch.float32, gen, docs=3)  # 200: exercises flex padding
    batch_cpu["loss_mask"] = (torch.rand(2, 200, generator=gen) > 0.3).long()
    torch.manual_seed(0)
    draft_cpu = Eagle3Draft(cfg)

    def run(dev, attention, compile_, autocast):
        draft = Eagle3Draft(cfg).to(dev)
        draft.load_state_dict(draft_cpu.state_dict())
        head = TargetHead(*(tensors[k].to(dev) for k in ("embed", "norm", "lm_head")),
                          cfg.rms_norm_eps, head_cpu.kept_ids.to(dev), compile=bool(compile_))
        batch = {k: v.to(dev) for k, v in batch_cpu.items()}
        model = TTTModel(draft, num_steps=7, attention=attention, compile=compile_)
        dtype = torch.bfloat16 if autocast else torch.float32
        loss, stats, _ = train_step(model, head, batch, None, dtype, autocast, 1e9)
        grad = torch.cat([p.grad.flatten().float().cpu() for p in draft.parameters()])
        return float(loss), stats.cpu(), grad

    ref_loss, ref_stats, ref_grad = run("cpu", "sdpa", False, False)
    rows = []
    for label, args in checks:
        loss, stats, grad = run(device, *args)
        rows.append({"check": label, "loss_rel_err": abs(loss - ref_loss) / abs(ref_loss),
                     "grad_rel_err": float((grad - ref_grad).norm() / ref_grad.norm()),
                     "scored_equal": bool(torch.equal(stats[:, 1], ref_stats[:, 1])),
                     "acc_step0_diff": float((stats[0, 3] - ref_stats[0, 3]) / ref_stats[0, 1])})
    return rows


def add_shape_args(p) -> None:
    """The draft's shape (default Llama-3.1-8B-shaped) and the batch: shared with bench/train_dist.py."""
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--n-aux", type=int, default=3)
    p.add_argument("--ttt", type=int, default=7)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)


def describe_shape(a) -> str:
    return (f"H {a.hidden}, heads {a.heads}/{a.kv_heads}, MLP {a.intermediate}, vocab {a.vocab}->{a.draft_vocab}, "
            f"TTT {a.ttt}, {a.batch}x{a.seq}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(p)
    p.add_argument("--check", action="store_true", help="the GPU kernels against CPU float32 before timing")
    p.add_argument("--loop", default="auto", help="the loop runs, each a train.compile value with options, "
                                                   "e.g. 'auto,auto+muon' or 'auto,false'")
    p.add_argument("--loop-steps", type=int, default=30)
    p.add_argument("--loop-trainable", type=float, default=1.0, metavar="F",
                   help="the share of each loop sample's tokens with loss (the rest a prompt before them); "
                        "default 1: every token, this bench's worst case for train.loss_rows_only")
    p.add_argument("--loop-trace", type=int, default=0, metavar="N",
                   help="profile N of each loop run's last steps: GPU busy and idle, host time in and between steps")
    p.add_argument("--loop-samples", type=int, default=64,
                   help="samples in the loop's store (one per step): fewer than --loop-steps makes epochs, and from "
                        "the second the target head takes in_vocab from its cache (train.target_cache)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench/train.py times the train loop on a GPU; no CUDA device is visible")
    device = torch.device("cuda")
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(a)}
    if a.check:
        out["check"] = correctness_check(device)
        for r in out["check"]:
            print(json.dumps(r), flush=True)
    out["results"] = []
    for mode in [m for m in a.loop.split(",") if m]:
        try:
            r = run_loop(a, device, mode)
        except Exception as e:  # report and go on: the table below is the point of the call
            r = {"variant": f"loop ({mode})", "error": f"{type(e).__name__}: {str(e)[:300]}"}
        out["results"].append(r)
        print(json.dumps(r), flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_train.json").write_text(json.dumps(out, indent=2))
    print("\nloop rows: eagle3.train.loop.train itself (Accelerate, data loader, metrics) on in-memory random samples; "
          "step ms\nand tokens/s: the median of the loop's own logged windows; synced ms: the steps from the 10th to "
          "the last on the\nhost's clock (the device synchronised at both ends); alloc GiB: the loop's own peak, less "
          "what earlier runs in this\nprocess left allocated; wall s: the whole run, compilation included.")
    print(f"{out['device']}, torch {out['torch']}: {describe_shape(a)} tokens, bf16")
    print(f"{'variant':<24}{'step ms':>10}{'tokens/s':>11}{'MFU':>7}{'alloc GiB':>11}{'synced ms':>11}{'wall s':>8}")
    for r in out["results"]:
        if "error" in r:
            print(f"{r['variant']:<24} {r['error'][:80]}")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
        print(f"{r['variant']:<24}{r['step_ms']:>10.1f}{r['tokens_per_s']:>11.0f}{mfu:>7}{r['peak_alloc_gib']:>11.2f}"
              f"{r.get('wall_step_ms', float('nan')):>11.1f}{r['wall_s']:>8.0f}")


if __name__ == "__main__":
    main()
