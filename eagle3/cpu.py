"""CPU specifics: how many threads torch may use, and whether bf16 matmuls are native.

Thread counts (``cpu_threads``): N > 0 forces N threads for every CPU phase; 0 (the default) lets
each CPU-heavy phase measure: :func:`threads_for` times a short workload of the phase's kind at each
candidate count (1, 2, 4, ... up to the cores this process may run on) and keeps the fastest, the
fewer threads when within 5%. Two kinds, because contention hurts them differently: ``batch``
(training, prefill-heavy extraction: large matmuls) and ``decode`` (vLLM engines and the offline
evaluator: many small ops per token, each ending on a barrier). A probe costs about 0.1 s per
candidate and is cached for the stage (:func:`new_stage` clears it), so a stage that starts three
engines measures once. What the probe picks against what each count gives on the real work, on an
idle and on a loaded machine: bench/results/threads_cpu_202611.md.

Why fewer threads can be faster: every op ends on an OpenMP barrier, and on a machine shared with
other jobs a thread the scheduler has parked makes the others wait for a time slice. Measured on the
2-core machine this project develops on (load 3-4 from other jobs): the SmolLM2-135M draft (TTT 3,
512-token rows, bf16) trained at 356 tokens/s with one thread and 193 with two; at load ~9, 290 vs
47. The HF target's greedy decoding in the offline evaluator (many small ops per token) suffers the
same way: 116 s per batch of 8 prompts x 64 tokens with two threads, 18 s with one.

Imported by the CLI: torch is imported inside the functions.
"""
from __future__ import annotations

import logging
import os
import time

log = logging.getLogger("eagle3")


def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX).

    With it, bf16 GEMMs run about twice as fast as float32 (measured for the SmolLM2-135M draft's
    TTT step on an AMD EPYC with AVX512-BF16: forward+backward+target head 1.70 s vs 3.40 s per
    512 tokens); without it oneDNN converts every operand and bf16 is slower than float32.
    """
    import torch

    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        fn = getattr(torch.cpu, probe, None)
        if fn is not None:
            try:
                if fn():
                    return True
            except Exception:  # a private probe that changed; the flags below decide
                pass
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def bf16_is_fast(on_gpu: bool) -> bool:
    """Whether bfloat16 is the fast precision here: on a GPU, or on a CPU that multiplies it natively
    (what ``train.mixed_precision=native`` and ``prepare.regen.dtype=native`` pick bf16 by)."""
    return on_gpu or native_bf16()


def resolve_precision(setting: str, on_gpu: bool) -> str:
    """train.mixed_precision as Accelerate takes it: ``auto`` = bf16 on a GPU, else no; ``native`` = bf16
    where bf16 is fast (a GPU, a CPU with AVX512-BF16/AMX: bf16_is_fast), else no."""
    if setting == "auto":
        return "bf16" if on_gpu else "no"
    if setting == "native":
        mp = "bf16" if bf16_is_fast(on_gpu) else "no"
        if mp == "no":
            log.info("train.mixed_precision=native: this CPU has no native bfloat16 (AVX512-BF16/AMX), so the draft "
                     "trains in float32")
        return mp
    return setting


def warn_if_slow_bf16(mixed_precision: str) -> None:
    if mixed_precision == "bf16" and not native_bf16():
        log.warning("train.mixed_precision=bf16 on a CPU without native bfloat16 (no AVX512-BF16/AMX): every "
                    "matmul converts its operands and runs slower than float32; set train.mixed_precision=no")


# the run's policy: 0 = probe per phase, N > 0 = N everywhere (set by the runner from cfg.cpu_threads)
_policy = {"threads": 0}
_chosen: dict = {}  # kind -> threads picked by the probe in this stage


def set_policy(threads: int) -> None:
    _policy["threads"] = int(threads)
    _chosen.clear()


def new_stage() -> None:
    """Forget the probes' picks: load changes between stages, so each stage measures again."""
    _chosen.clear()


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def candidates(cores: int) -> list[int]:
    """1, 2, 4, ... and the core count itself."""
    out, n = [], 1
    while n < cores:
        out.append(n)
        n *= 2
    return out + [cores]


# (rows, width) of the probe's matmuls: a 512-token row block through a ~1k-wide layer (batch), and
# 8 tokens through it (decode: one step of a small batch)
_PROBE_SHAPES = {"batch": (512, 1024), "decode": (8, 1024)}


def _probe_rate(n: int, kind: str, seconds: float) -> float:
    """Probe workloads per second with n threads: a matmul of the kind's shape, then a few
    elementwise ops (each ends on an OpenMP barrier, where a descheduled thread makes the others
    wait)."""
    import torch

    rows, width = _PROBE_SHAPES[kind]
    torch._C.set_num_threads(n)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, width, generator=g)
    w = torch.randn(width, width, generator=g) / width ** 0.5

    def work():
        y = torch.nn.functional.linear(x, w)
        y = torch.nn.functional.silu(y) * y
        return (y + x).sum()

    for _ in range(3):  # warm up the thread pool at this size
        work()
    done, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds:
        work()
        done += 1
    return done / elapsed


def probe_threads(kind: str, seconds: float = 0.1, cores: int | None = None) -> tuple[int, dict]:
    """(threads, {threads: workloads per second}): the fastest count for this kind of work now,
    preferring fewer threads when within 5% of the fastest. Leaves torch at the chosen count."""
    import torch

    if kind not in _PROBE_SHAPES:
        raise ValueError(f"probe kind must be one of {sorted(_PROBE_SHAPES)}, got {kind!r}")
    rates = {n: _probe_rate(n, kind, seconds) for n in candidates(cores or available_cores())}
    best = max(rates.values())
    pick = min(n for n, r in rates.items() if r >= 0.95 * best)
    torch._C.set_num_threads(pick)
    return pick, rates


def threads_for(kind: str) -> int:
    """The torch thread count for a CPU phase of this kind: forced by cpu_threads=N, else by
    OMP_NUM_THREADS when it is set (the test suite sets 1, so that two runs it compares use the
    same count), else probed (once per stage and kind)."""
    if _policy["threads"] > 0:
        return _policy["threads"]
    omp = os.environ.get("OMP_NUM_THREADS", "")
    if omp.isdigit() and int(omp) > 0:
        return int(omp)
    if kind not in _chosen:
        n, rates = probe_threads(kind)
        _chosen[kind] = n
        log.info("cpu threads for %s work: %d (probe, workloads/s by threads: %s; cpu_threads=N forces N)", kind, n,
                 ", ".join(f"{k}: {v:.0f}" for k, v in rates.items()))
    return _chosen[kind]


class phase_threads:
    """``with phase_threads(kind):`` torch's threads set for a CPU phase (:func:`threads_for`),
    restored after; nothing when the phase runs on a GPU."""

    def __init__(self, kind: str, on_cpu: bool = True):
        self.kind, self.on_cpu, self.before = kind, on_cpu, None

    def __enter__(self):
        if self.on_cpu:
            import torch

            self.before = torch.get_num_threads()
            torch._C.set_num_threads(threads_for(self.kind))
        return self

    def __exit__(self, *exc):
        if self.before is not None:
            import torch

            torch._C.set_num_threads(self.before)
        return False
