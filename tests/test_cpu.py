"""CPU thread counts: each CPU phase measures (cpu_threads=0), or is told (cpu_threads=N, OMP_NUM_THREADS)."""
from __future__ import annotations

import logging

import pytest
import torch

import eagle3.cpu as cpu


@pytest.fixture(autouse=True)
def _clean_policy():
    before = torch.get_num_threads()
    cpu.set_policy(0)
    yield
    cpu.set_policy(0)
    torch._C.set_num_threads(before)


def test_candidates_are_powers_of_two_and_the_core_count():
    assert cpu.candidates(1) == [1]
    assert cpu.candidates(2) == [1, 2]
    assert cpu.candidates(6) == [1, 2, 4, 6]
    assert cpu.candidates(8) == [1, 2, 4, 8]


@pytest.mark.parametrize("rates, pick", [({1: 100.0, 2: 103.0}, 1),        # within 5%: fewer threads
                                         ({1: 100.0, 2: 150.0}, 2),
                                         ({1: 100.0, 2: 150.0, 4: 155.0}, 2),
                                         ({1: 100.0, 2: 40.0, 4: 10.0}, 1),  # a loaded machine
                                         ({1: 10.0, 2: 19.0, 4: 40.0}, 4)])
def test_probe_keeps_the_fastest_count_preferring_fewer_threads(monkeypatch, rates, pick):
    monkeypatch.setattr(cpu, "_probe_rate", lambda n, kind, seconds: rates[n])
    got, measured = cpu.probe_threads("batch", cores=max(rates))
    assert (got, measured) == (pick, rates)
    assert torch.get_num_threads() == pick


def test_probe_measures_every_candidate_for_real():
    n, rates = cpu.probe_threads("decode", seconds=0.02, cores=2)
    assert set(rates) == {1, 2} and all(r > 0 for r in rates.values())
    assert n in (1, 2) and rates[n] >= 0.95 * max(rates.values())
    with pytest.raises(ValueError, match="probe kind must be one of"):
        cpu.probe_threads("prefill")


def test_threads_for_precedence_and_one_probe_per_stage(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu, "probe_threads", lambda kind: (calls.append(kind) or 2, {1: 1.0, 2: 2.0}))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert cpu.threads_for("batch") == 2 and cpu.threads_for("batch") == 2 and calls == ["batch"]
    assert cpu.threads_for("decode") == 2 and calls == ["batch", "decode"]
    cpu.new_stage()  # load changes between stages: measured again
    cpu.threads_for("batch")
    assert calls == ["batch", "decode", "batch"]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu.threads_for("batch") == 3
    cpu.set_policy(5)  # cpu_threads=5 beats the environment
    assert cpu.threads_for("decode") == 5 and len(calls) == 3


def test_runner_sets_each_stage_threads(monkeypatch, compose, tmp_path, caplog):
    """cpu_threads=0 and no OMP_NUM_THREADS: the runner probes at the stage's start (the log says
    what it measured) and the stage runs with the pick; cpu_threads=N: N, no probe; torch's count
    is restored after the stage."""
    import eagle3.stages.prepare
    from eagle3.runner import run

    seen = []
    monkeypatch.setattr(eagle3.stages.prepare, "run", lambda cfg, manifest: seen.append(torch.get_num_threads()))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch._C.set_num_threads(1)
    with caplog.at_level(logging.INFO, logger="eagle3"):
        run(compose("stage=prepare", f"workspace={tmp_path}", "progress=false"))
    # prepare regenerates every conversation's turn at once: large matmuls, probed as batch work
    probe = [r.getMessage() for r in caplog.records if "cpu threads for batch work" in r.getMessage()]
    assert len(probe) == 1 and f"work: {seen[0]} (probe" in probe[0], probe
    assert torch.get_num_threads() == 1
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="eagle3"):
        run(compose("stage=prepare", f"workspace={tmp_path}", "progress=false", "cpu_threads=2"))
    assert seen[-1] == 2 and not [r for r in caplog.records if "probe" in r.getMessage()]
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize("native", [True, False])
def test_native_precision_is_bf16_only_where_bf16_is_fast(monkeypatch, native, caplog):
    """train.mixed_precision=native (and prepare.regen.dtype=native, by the same test): bf16 on a GPU and
    on a CPU that multiplies bf16 natively, float32 (``no``) on other CPUs, said in the log; ``auto``
    stays bf16 on a GPU and float32 on every CPU, and an explicit choice is kept. (The CPU's flags are
    set by the test: no machine here has both kinds.)"""
    monkeypatch.setattr(cpu, "native_bf16", lambda: native)
    with caplog.at_level(logging.INFO, logger="eagle3"):
        assert cpu.resolve_precision("native", on_gpu=False) == ("bf16" if native else "no")
    assert ("no native bfloat16" in caplog.text) is not native
    assert cpu.resolve_precision("native", on_gpu=True) == "bf16"
    assert cpu.resolve_precision("auto", on_gpu=False) == "no" and cpu.resolve_precision("auto", on_gpu=True) == "bf16"
    assert cpu.resolve_precision("bf16", on_gpu=False) == "bf16" and cpu.resolve_precision("no", on_gpu=True) == "no"
    assert cpu.bf16_is_fast(on_gpu=False) is native and cpu.bf16_is_fast(on_gpu=True)


def test_this_machine_reads_its_bf16_support_from_torch_and_the_cpu_flags():
    """native_bf16 says what the CPU's flags say (AVX512-BF16 or AMX), on this machine for real."""
    with open("/proc/cpuinfo") as f:
        flags = next((line for line in f if line.startswith("flags")), "").split()
    assert cpu.native_bf16() is ("avx512_bf16" in flags or "amx_bf16" in flags)
