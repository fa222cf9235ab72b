"""The KV-cache check (eagle3.kv_cache) on a CUDA device: sized by the device's free memory.
Skipped without a CUDA device (CI has none); needs torch and psutil only, no vLLM."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

pytestmark = pytest.mark.gpu


def test_a_kv_cache_larger_than_the_free_device_memory_is_refused():
    from eagle3.kv_cache import GiB, KVCacheError, check_fits

    free, total = torch.cuda.mem_get_info()
    check_fits("export.kv_cache_gb", 1.0)
    with pytest.raises(KVCacheError, match=r"export.kv_cache_gb=\d+ does not fit.*the GPU \(.*\) has .* GiB free"):
        check_fits("export.kv_cache_gb", int(total / GiB) + 1)
    with pytest.raises(KVCacheError, match=r"Set export.kv_cache_gb to at most 0\.[45]"):
        check_fits("export.kv_cache_gb", 1.0, weights=int(free - 0.5 * GiB))
    print(f"kv_cache check on {torch.cuda.get_device_name()}: {free / GiB:.1f} of {total / GiB:.1f} GiB free")
