"""Benchmark of one EAGLE-3 training step (TTT forward + backward + clipping + AdamW).

Random inputs of a configurable shape; default a Llama-3.1-8B-shaped draft (H 4096, 32 heads,
8 KV heads, MLP 14336, vocab 128256, draft vocab 32000, TTT 7, 2048 tokens, batch 1, bf16).
What one step computes is exactly the train stage's step: the target head (full-vocab argmax
mask + draft-vocab softmax, chunked), embeddings, the TTT model (eagle3.train.ttt.TTTModel)
with its loss over the same positions, backward, grad-norm clipping and fused AdamW.

    python bench/train.py                      # all variants, default shape
    python bench/train.py --check              # correctness vs CPU float32 first (small shape)
    python bench/train.py --variants flex_compiled --seq 4096
    python bench/train.py --variants flex_compiled --profile --sync-check --loop auto
        # GPU time by kernel class and idle gaps; host-device syncs of a step; the train loop itself
    python bench/train.py --variants flex_compiled,flex_compiled+torchclip,flex_compiled+eagerhead
        # what folding the clip into AdamW and compiling the target head gain
    python bench/train.py --variants flex_compiled,flex_compiled+fp8 --loop auto,auto+fp8
        # the step fed from an fp8 store's values + scales (dequantised in the step) vs bf16
    python bench/train.py --variants flex_compiled --loop auto,auto+muon,auto+muontorch
        # the train loop with train.optimizer=muon (Muon on the 2-D weights + AdamW) vs AdamW;
        # +muon: FastMuon (train.muon_impl=fast), +muontorch: torch.optim.Muon
    python bench/train.py --variants '' --loop auto,auto+nocache --loop-samples 8 --loop-steps 30
        # several epochs of 8 samples: the target head's in_vocab cache (train.target_cache) on / off

Measurements and what made the difference: bench/results/train_h200_202611.md.

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
from eagle3.train.metrics import peak_flops, ttt_flops_per_token  # noqa: E402
from eagle3.train.optim import can_fold, fold_clip  # noqa: E402
from eagle3.train.target_head import TargetHead, model_inputs  # noqa: E402
from eagle3.train.ttt import TTTModel  # noqa: E402

VARIANTS = {  # name: (attention backend, torch.compile of the whole unrolled TTT forward)
    "sdpa_eager": ("sdpa", False),
    "flex_eager": ("flex", False),  # flex_attention itself is always compiled on CUDA
    # the diagonals inside one flex call over the keys of all steps (the former layout)
    "stacked_compiled": ("flex_stacked", True),
    # flex over the causal prefix alone + the diagonals merged by log-sum-exp (the train stage's)
    "flex_compiled": ("flex", True),
    "flex_cudagraphs": ("flex", "cudagraphs"),  # compiled + CUDA-graph replay (not used by the train loop)
}
# options appended to a variant name, for measuring what each part of the train loop's step gains:
# "+torchclip": clip with torch.nn.utils.clip_grad_norm_ (a separate pass over the gradients)
# instead of folding the clip into fused AdamW; "+eagerhead": the target head not compiled;
# "+fp8": the batch as an fp8 store gives it (float8 e4m3 states + float32 scales per token and
# layer, eagle3.fp8), dequantised inside the step by model_inputs as in the train stage
OPTIONS = ("torchclip", "eagerhead", "fp8")


def to_fp8(batch: dict, n_aux: int) -> dict:
    """A batch of bf16 states -> the same states as an fp8 store's collated batch (values + scales)."""
    from eagle3.fp8 import quantize

    out = dict(batch)
    B, T, _ = batch["aux_hidden_states"].shape
    aux = batch["aux_hidden_states"].view(B, T, n_aux, -1)
    av, as_ = quantize(aux)
    lv, ls = quantize(batch["last_hidden_state"])
    out.update(aux_hidden_states=av.view(B, T, -1), aux_scales=as_, last_hidden_state=lv, last_scales=ls)
    return out


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


PHASES = ("target head", "forward", "backward", "clip", "adamw")


def train_step(model, head, batch, opt, compute_dtype, autocast: bool, clip: float, fold: bool = True,
               marks: list | None = None):
    """One step as the train loop runs it. ``fold``: clipping folded into fused AdamW's kernel
    (eagle3/train/optim.py, what the loop does on one GPU) or torch's clip_grad_norm_.
    ``marks``: CUDA events appended at the phase boundaries (PHASES), which time each phase on
    the GPU without a host sync."""
    def mark():
        if marks is not None:
            marks.append(torch.cuda.Event(enable_timing=True))
            marks[-1].record()
    mark()
    inputs = model_inputs(head, batch, compute_dtype)
    mark()
    with torch.autocast(batch["loss_mask"].device.type, dtype=torch.bfloat16, enabled=autocast):
        loss, stats = model(**inputs)
    mark()
    loss.backward()
    mark()
    if opt is not None and fold and can_fold(opt):
        gnorm = fold_clip(opt, model.parameters(), clip)
    else:
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    mark()
    if opt is not None:
        opt.step()
        opt.zero_grad(set_to_none=True)
    mark()
    return loss.detach(), stats, gnorm


def run_variant(a, name, device) -> dict:
    base, *opts = name.split("+")
    if base not in VARIANTS or not set(opts) <= set(OPTIONS):
        raise ValueError(f"unknown variant {name!r}: one of {sorted(VARIANTS)}, with options from "
                         + ", ".join(f"'+{o}'" for o in OPTIONS))
    attention, compile_ = VARIANTS[base]
    fold = "torchclip" not in opts
    torch.cuda.empty_cache()
    gen = torch.Generator(device=device).manual_seed(0)
    cfg = make_config(a)
    draft = Eagle3Draft(cfg).to(device)  # fp32 master weights
    head, _ = make_head(cfg, device, torch.bfloat16, gen)
    head.compile = bool(compile_) and "eagerhead" not in opts  # as the train loop sets it
    draft.set_vocab_mapping(head.kept_ids - torch.arange(cfg.draft_vocab_size, device=device),
                            torch.zeros(cfg.vocab_size, dtype=torch.bool, device=device).index_fill_(0, head.kept_ids, True))
    model = TTTModel(draft, num_steps=a.ttt, decay=0.8, attention=attention, compile=compile_)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, betas=(0.9, 0.95),
                            weight_decay=0.0, fused=True)
    batches = [make_batch(cfg, a.batch, a.seq, device, torch.bfloat16, gen) for _ in range(2)]
    if "fp8" in opts:
        batches = [to_fp8(b, cfg.num_aux_hidden_states) for b in batches]
    t0 = time.time()
    for i in range(a.warmup):
        train_step(model, head, batches[i % 2], opt, torch.bfloat16, True, 0.5, fold)
    torch.cuda.synchronize()
    warm_s = time.time() - t0
    torch.cuda.reset_peak_memory_stats()
    # synced: each step timed alone (host waits for the GPU every step)
    synced, losses = [], []
    for i in range(a.steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss, _, _ = train_step(model, head, batches[i % 2], opt, torch.bfloat16, True, 0.5, fold)
        end.record()
        end.synchronize()
        synced.append(start.elapsed_time(end) / 1e3)
        losses.append(float(loss))
    # pipelined: as the train loop runs (no host sync between steps, so the host prepares the
    # next step while the GPU works); mean step time of a block, median over blocks
    blocks, host = [], []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        h0 = time.perf_counter()
        for i in range(a.steps):
            train_step(model, head, batches[i % 2], opt, torch.bfloat16, True, 0.5, fold)
        # host time per step to issue the block (no sync inside). Once CUDA's launch queue is full the
        # host waits on it, so where the GPU is slower this reads about (steps - queued) / steps of
        # the GPU's time, not the host's own cost (--loop-trace measures that)
        host.append((time.perf_counter() - h0) / a.steps)
        end.record()
        end.synchronize()
        blocks.append(start.elapsed_time(end) / 1e3 / a.steps)
    med = statistics.median(blocks)
    # GPU time per phase: events at the phase boundaries of back-to-back steps (no host sync)
    marks = []
    for i in range(a.steps):
        train_step(model, head, batches[i % 2], opt, torch.bfloat16, True, 0.5, fold, marks)
    marks[-1].synchronize()
    n = len(PHASES) + 1
    phases = {p: statistics.median(marks[s * n + k].elapsed_time(marks[s * n + k + 1]) for s in range(a.steps))
              for k, p in enumerate(PHASES)}
    with torch.no_grad():
        last = batches[0]["last_hidden_state"]
        if "last_scales" in batches[0]:
            from eagle3.fp8 import dequantize

            last = dequantize(last, batches[0]["last_scales"])
        in_vocab = float(head.targets(last, torch.bfloat16)[1].float().mean())
    if a.profile:
        profile_steps(model, head, batches[0], opt, fold)
    syncs = sync_check(model, head, batches[0], opt, fold) if a.sync_check else None
    tokens = a.batch * a.seq
    flops = ttt_flops_per_token(cfg, a.seq, a.ttt, cfg.vocab_size) * tokens
    peak = peak_flops(torch.cuda.get_device_name())
    res = {"variant": name, "step_ms": med * 1e3, "step_ms_blocks": [t * 1e3 for t in blocks],
           "step_ms_synced": statistics.median(synced) * 1e3, "host_ms": statistics.median(host) * 1e3,
           "tokens_per_s": tokens / med, "peak_alloc_gib": torch.cuda.max_memory_allocated() / 2**30,
           "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30, "tflops": flops / med / 1e12,
           "mfu": flops / med / peak if peak else None, "phase_ms": phases, "warmup_s": warm_s, "in_vocab": in_vocab, "sync_sites": syncs, "losses": losses}
    del model, draft, head, opt, batches
    return res


CHECKS = [("gpu fp32 sdpa eager", ("sdpa", False, False)), ("gpu fp32 flex compiled", ("flex", True, False)),
          ("gpu fp32 flex_stacked compiled", ("flex_stacked", True, False)),
          ("gpu bf16 sdpa eager", ("sdpa", False, True)), ("gpu bf16 flex compiled", ("flex", True, True))]


def loop_inputs(a, dtype=torch.bfloat16, fp8: bool = False):
    """TrainInputs for eagle3.train.loop.train: an in-memory store of random samples of the bench
    shape (``a.loop_samples`` rows, default 64, of ``a.seq`` tokens cycling over 4 distinct samples;
    no disk I/O) and a random target head. Seeded: every process builds the same inputs. ``fp8``:
    the items as an fp8 store read raw gives them (float8 values + float32 scales; the loop
    dequantises on the device)."""
    from eagle3.train.loop import TrainInputs
    from eagle3.train.source import HiddenStateSource

    cfg = make_config(a)
    n = getattr(a, "loop_samples", 64)  # bench/train_dist.py's arguments have no --loop-samples
    gen = torch.Generator().manual_seed(0)
    head, tensors = make_head(cfg, "cpu", dtype, gen)
    items = [{k: v[0] for k, v in make_batch(cfg, 1, a.seq, "cpu", dtype, gen).items()
              if k in ("input_ids", "loss_mask", "aux_hidden_states", "last_hidden_state")} for _ in range(4)]
    prompt = round((1 - getattr(a, "loop_trainable", 1.0)) * a.seq)
    for it in items:
        it["aux_hidden_states"] = it["aux_hidden_states"].view(a.seq, cfg.num_aux_hidden_states, cfg.hidden_size)
        it["loss_mask"] = it["loss_mask"].bool()
        it["loss_mask"][:prompt] = False  # --loop-trainable: a prompt without loss first
        if fp8:
            from eagle3.fp8 import quantize

            it["aux_hidden_states"], it["aux_scales"] = quantize(it["aux_hidden_states"])
            it["last_hidden_state"], it["last_scales"] = quantize(it["last_hidden_state"])

    class Store(HiddenStateSource):
        lengths = np.full(n, a.seq)
        layer_ids = tuple(cfg.aux_layer_ids)

        def __len__(self):
            return n

        def __getitem__(self, i):
            return items[i % 4]

    kept = head.kept_ids
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[kept] = True
    return TrainInputs(Store(), None, tensors, cfg.rms_norm_eps, kept - torch.arange(cfg.draft_vocab_size), t2d, cfg)


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

    # "auto+fp8": the store's items as fp8 values + scales; "auto+muon": train.optimizer=muon (FastMuon,
    # train.muon_impl=fast); "auto+muontorch": the same with torch.optim.Muon (train.muon_impl=torch);
    # "auto+nocache": train.target_cache=false (the head computes in_vocab on every pass);
    # "+cadamw" / "+fadamw": train.adamw_impl=compiled / fused; "+allrows": train.loss_rows_only=false
    # (the draft head on every position, not only on the loss rows); "+panels": train.muon_sym=panels
    # (FastMuon's symmetric products as cuBLAS row panels, not the Triton tile triangle); "+unfused" /
    # "+fused": train.head_loss (the draft head and its loss as torch code for Inductor / one op);
    # "+synclog": the loop writes each logged window before its next step, waiting for the GPU (as it
    # did before its logs were deferred: eagle3.train.loop.SYNC_LOGS); "+f8mm" / "+f8mmw":
    # train.fp8_matmul=on / bf16_wgrad (the layer's and fc's matmuls in float8)
    mode, *opts = compile_mode.split("+")
    inputs = loop_inputs(a, fp8="fp8" in opts)
    muon = "muon" in opts or "muontorch" in opts
    impl = "compiled" if "cadamw" in opts else "fused" if "fadamw" in opts else "auto"
    tcfg = loop_config(a, mode, optimizer="muon" if muon else "adamw", adamw_impl=impl, loss_rows_only="allrows" not in opts,
                       muon_impl="torch" if "muontorch" in opts else "fast", target_cache="nocache" not in opts,
                       muon_sym="panels" if "panels" in opts else "auto",
                       head_loss=next((o for o in opts if o in ("fused", "unfused")), "auto"),
                       fp8_matmul="on" if "f8mm" in opts else "bf16_wgrad" if "f8mmw" in opts else "off")
    # what earlier runs in this process left allocated (compiled code holds on to their models) is not
    # this run's: the peak is counted from a reset, less that base
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) / 2**30
    import eagle3.train.loop as L

    L.SYNC_LOGS = "synclog" in opts
    try:
        with tempfile.TemporaryDirectory() as out, loop_trace(a, compile_mode) as traced, \
                wall_clock(a.loop_steps) as clock:
            t0 = time.time()
            train(tcfg, inputs, Path(out), progress=False)
            wall = time.time() - t0
            recs = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    finally:
        L.SYNC_LOGS = False
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


def sync_check(model, head, batch, opt, fold):
    """Run one step with CUDA sync debugging: every host<->device synchronisation (which stalls the
    pipeline of queued GPU work) is printed with the Python stack that caused it."""
    import traceback
    import warnings

    seen = []

    def show(message, category, filename, lineno, file=None, line=None):
        stack = "".join(traceback.format_stack(limit=12)[:-1])
        if stack not in seen:
            seen.append(stack)
            print(f"SYNC: {message}\n{stack}", flush=True)

    old = warnings.showwarning
    warnings.showwarning = show
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
            train_step(model, head, batch, opt, torch.bfloat16, True, 0.5, fold)
            torch.cuda.set_sync_debug_mode("default")
    finally:
        warnings.showwarning = old
    print(f"sync check: {len(seen)} distinct synchronising call sites in one step", flush=True)
    return len(seen)


def profile_steps(model, head, batch, opt, fold):
    """torch.profiler over two steps: GPU kernel time by class and the idle gaps between kernels
    (host launch overhead shows up as gaps, not as kernel time)."""
    import collections
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            train_step(model, head, batch, opt, torch.bfloat16, True, 0.5, fold)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        trace = json.load(open(f"{tmp}/trace.json"))
    ev = sorted((e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                key=lambda e: e["ts"])

    def cls(name):
        n = name.lower()
        for c, keys in (("gemm", ("nvjet", "gemm", "cutlass")), ("flex attention", ("flex",)),
                        ("adamw", ("adam", "fusedopti")), ("triton (compiled)", ("triton",))):
            if any(k in n for k in keys):
                return c
        return "aten elementwise/copy"
    by, top, count = collections.Counter(), collections.Counter(), collections.Counter()
    for e in ev:
        by[cls(e["name"])] += e["dur"] / 2e3
        top[e["name"][:90]] += e["dur"] / 2e3
        count[e["name"][:90]] += 1
    gaps, end, big = 0.0, ev[0]["ts"] + ev[0]["dur"], []
    for prev, e in zip(ev, ev[1:]):
        gap = e["ts"] - end
        if gap > 0:
            gaps += gap
            big.append((gap, prev["name"][:60], e["name"][:60]))
        end = max(end, e["ts"] + e["dur"])
    busy = sum(by.values())
    print(f"profile (ms per step): kernels {busy:.1f}, idle gaps {gaps / 2e3:.1f}; " +
          ", ".join(f"{c} {t:.1f}" for c, t in by.most_common()), flush=True)
    print("profile top kernels (ms per step, launches per step):", flush=True)
    for name, t in top.most_common(30):
        print(f"  {t:7.2f} ms {count[name] / 2:6.0f}x  {name}", flush=True)
    print("profile largest idle gaps (ms, kernel before -> after):", flush=True)
    for gap, a, b in sorted(big, reverse=True)[:10]:
        print(f"  {gap / 1e3:7.3f} ms  {a} -> {b}", flush=True)


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
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--check", action="store_true", help="correctness vs CPU float32 before timing")
    p.add_argument("--profile", action="store_true", help="torch.profiler summary of each variant")
    p.add_argument("--sync-check", action="store_true", help="print host-device syncs of one step")
    p.add_argument("--loop", default="", help="also run the train stage's loop with these train.compile values, "
                                               "e.g. 'auto' or 'auto,false'")
    p.add_argument("--loop-steps", type=int, default=30)
    p.add_argument("--loop-trainable", type=float, default=1.0, metavar="F",
                   help="the share of each loop sample's tokens with loss (the rest a prompt before them); "
                        "default 1: every token, this bench's worst case for train.loss_rows_only")
    p.add_argument("--loop-trace", type=int, default=0, metavar="N",
                   help="profile N of each loop run's last steps: GPU busy and idle, host time in and between steps")
    p.add_argument("--loop-samples", type=int, default=64,
                   help="samples in the loop's store (one per step): fewer than --loop-steps makes epochs, and from "
                        "the second the target head takes in_vocab from its cache (train.target_cache; +nocache: off)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench/train.py times a GPU step; no CUDA device is visible")
    device = torch.device("cuda")
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(a)}
    if a.check:
        out["check"] = correctness_check(device)
        for r in out["check"]:
            print(json.dumps(r), flush=True)
    out["results"] = []
    for name in [v for v in a.variants.split(",") if v]:
        try:
            r = run_variant(a, name, device)
        except torch.OutOfMemoryError as e:
            r = {"variant": name, "error": f"OOM: {str(e)[:200]}"}
        except Exception as e:  # report and go on: the table below is the point of the call
            r = {"variant": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        out["results"].append(r)
        print(json.dumps(r), flush=True)
    for mode in [m for m in a.loop.split(",") if m]:
        try:
            r = run_loop(a, device, mode)
        except Exception as e:  # report and go on: the table below is the point of the call
            r = {"variant": f"loop ({mode})", "error": f"{type(e).__name__}: {str(e)[:300]}"}
        out["results"].append(r)
        print(json.dumps(r), flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_train.json").write_text(json.dumps(out, indent=2))
    print("\nstep ms / tokens/s: steps run back to back as in the train loop; synced ms: one step timed "
          "alone\n(host and GPU serialised); host ms: host time per step to issue --steps steps (it includes waits on a full CUDA\n"
          "launch queue, so below the step time it does not measure the host's cost: --loop-trace does). Peak memory: "
          "torch.cuda.max_memory_allocated / _reserved.\nloop rows: eagle3.train.loop.train itself (Accelerate, "
          "data loader, metrics) on in-memory random samples; its last column is the wall time incl. compilation;\n"
          "their step ms is the median of the loop's own logged windows, their synced ms the steps from the 10th to the "
          "last\non the host's clock (the device synchronised at both ends); their peak memory is the loop's own: less "
          "what earlier runs\nin this process left allocated.")
    print(f"{out['device']}, torch {out['torch']}: {describe_shape(a)} tokens, bf16")
    print(f"{'variant':<24}{'step ms':>10}{'tokens/s':>11}{'TFLOP/s':>9}{'MFU':>7}{'alloc GiB':>11}{'resv GiB':>10}"
          f"{'synced ms':>11}{'host ms':>9}{'warm s':>8}")
    for r in out["results"]:
        if "error" in r:
            print(f"{r['variant']:<24} {r['error'][:80]}")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
        if r["variant"].startswith("loop"):
            print(f"{r['variant']:<24}{r['step_ms']:>10.1f}{r['tokens_per_s']:>11.0f}{'':>9}{mfu:>7}"
                  f"{r['peak_alloc_gib']:>11.2f}{'':>10}{r.get('wall_step_ms', float('nan')):>11.1f}{'':>9}"
                  f"{r['wall_s']:>8.0f}")
            continue
        print(f"{r['variant']:<24}{r['step_ms']:>10.1f}{r['tokens_per_s']:>11.0f}{r['tflops']:>9.0f}{mfu:>7}"
              f"{r['peak_alloc_gib']:>11.2f}{r['peak_reserved_gib']:>10.2f}{r['step_ms_synced']:>11.1f}"
              f"{r.get('host_ms', float('nan')):>9.1f}{r['warmup_s']:>8.0f}")
    print("GPU ms per phase (events at the phase boundaries, steps back to back):")
    print(f"{'variant':<24}" + "".join(f"{p:>13}" for p in PHASES))
    for r in out["results"]:
        if "phase_ms" in r:
            print(f"{r['variant']:<24}" + "".join(f"{r['phase_ms'][p]:>13.2f}" for p in PHASES))


if __name__ == "__main__":
    main()
