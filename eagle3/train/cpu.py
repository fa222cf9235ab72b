"""What training on a CPU needs to know about the CPU."""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("eagle3.train")


def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX).

    With it, bf16 GEMMs run about twice as fast as float32 (measured for the SmolLM2-135M draft's
    TTT step on an AMD EPYC with AVX512-BF16: forward+backward+target head 1.70 s vs 3.40 s per
    512 tokens); without it oneDNN converts every operand and bf16 is slower than float32.
    """
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


def warn_if_slow_bf16(mixed_precision: str) -> None:
    if mixed_precision == "bf16" and not native_bf16():
        log.warning("train.mixed_precision=bf16 on a CPU without native bfloat16 (no AVX512-BF16/AMX): every "
                    "matmul converts its operands and runs slower than float32; set train.mixed_precision=no")


class cpu_threads:
    """``with cpu_threads(n):`` torch's intra-op threads set to n (0: left alone), restored after.

    Measured on the 2-core machine this project develops on, shared with other jobs (load 3-4):
    the SmolLM2-135M draft (TTT 3, 512-token rows, bf16) trained at 356 tokens/s with one thread
    and 193 tokens/s with two; at load ~9, 290 vs 47. Every op ends on an OpenMP barrier, and a
    thread that the scheduler has parked makes the other wait for a time slice.
    """

    def __init__(self, n: int):
        self.n = int(n)
        self.before = None

    def __enter__(self):
        if self.n > 0:
            self.before = torch.get_num_threads()
            torch.set_num_threads(self.n)
        return self

    def __exit__(self, *exc):
        if self.before is not None:
            torch.set_num_threads(self.before)
        return False
