"""The KV cache a vLLM engine is given (``*.kv_cache_gb``), checked against this machine.

eagle3 passes ``kv_cache_gb`` to vLLM as ``kv_cache_memory_bytes`` (eagle3.vllm_compat), and vLLM
allocates it whole after loading the weights. One that does not fit used to surface only then,
minutes in, as vLLM's message naming its own flags (on a CPU ``--kv-cache-memory-bytes``,
``VLLM_CPU_KVCACHE_SPACE``), which a user of eagle3 never set. :func:`check_fits` refuses it
before the engine starts, naming the eagle3 key and what fits (memory available on a CPU, the
device's free memory on a GPU, less the weights); :func:`translate` turns vLLM's CPU message,
where it still comes (memory taken by others in between), into the same words. vLLM's own GPU
refusal was not seen here (no GPU vLLM on this project's machines) and is left as it is.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from .errors import Eagle3Error

GiB = 2**30
# vLLM's CPU worker (v1/worker/cpu_worker.py, determine_available_memory)
_VLLM_WORDS = ("--kv-cache-memory-bytes", "VLLM_CPU_KVCACHE_SPACE")


class KVCacheError(Eagle3Error):
    """The KV cache asked for does not fit in this machine's memory."""


def weights_bytes(*model_dirs) -> int:
    """Bytes of the safetensors weights in these model directories (what vLLM loads first)."""
    return sum(f.stat().st_size for d in model_dirs if d for f in Path(d).glob("*.safetensors"))


def check_fits(key: str, gb: float, weights: int = 0) -> None:
    """Raise when ``gb`` GiB of KV cache cannot fit beside ``weights`` bytes: in available memory on a
    CPU, in the free memory of the current device on a GPU (vLLM's engine runs there)."""
    import torch

    if torch.cuda.is_available():
        available, total = torch.cuda.mem_get_info()
        where = f"the GPU ({torch.cuda.get_device_name()}) has {available / GiB:.1f} of {total / GiB:.1f} GiB free"
    else:
        import psutil

        available = psutil.virtual_memory().available
        where = f"this machine has {available / GiB:.1f} GiB of memory available"
    fits = max(available - weights, 0)
    if gb * GiB > fits:
        raise KVCacheError(
            f"{key}={gb:g} does not fit: vLLM allocates the whole KV cache at start, and {where}, "
            f"{weights / GiB:.1f} GiB of which the weights it loads take. Set {key} to at most {fits / GiB:.1f} "
            f"(GiB; less on a GPU, where activations take their share), or free memory.")


def translate(e: BaseException, key: str, gb: float) -> Optional[KVCacheError]:
    """The eagle3 error for vLLM's "KV cache does not fit" (in ``e`` or what caused it), else None."""
    for _ in range(8):
        if e is None:
            return None
        text = str(e)
        if any(w in text for w in _VLLM_WORDS):
            m = re.search(r"Available memory on node \d+ \(([\d.]+)/([\d.]+) GiB\)", text)
            left = f" vLLM found {m.group(1)} GiB of {m.group(2)} GiB available after loading the weights." if m else ""
            return KVCacheError(f"{key}={gb:g} does not fit in this machine's memory.{left} Set {key} to less than "
                                f"that, or free memory. (vLLM said: {text.strip().splitlines()[-1][:300]})")
        e = e.__cause__ or e.__context__
    return None
