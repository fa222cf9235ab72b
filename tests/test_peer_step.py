"""bench/peers/peer_step.py at a tiny shape on CPU: every peer's step trains (its loss falls on the fixed
batch, the tensors its optimizer updates change) and its rows carry what the table prints.

A peer whose code is not importable here is skipped, with the reason: CI has neither speculators'
wheels nor a SpecForge source tree. To run those, install them as bench/peers/README.md says and
point PEER_STEP_SPECULATORS_PATH / PEER_STEP_SPECFORGE_PATH at them (defaults /tmp/specsite and
/tmp/specforge:/tmp/sfsite).
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench" / "peers" / "peer_step.py"
sys.path.insert(0, str(REPO / "bench" / "peers"))
import peer_step  # noqa: E402  (stdlib only at import)

TINY = ["--device", "cpu", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
        "--intermediate", "128", "--vocab", "1000", "--draft-vocab", "300", "--seq", "64", "--steps", "3",
        "--warmup", "2"]
TOKENS, STEPS, WARMUP = 64, 3, 2
PROBES = {"speculators": "import speculators.train.cli, speculators.train.trainer, speculators.models.eagle3.core",
          "specforge": "import specforge.algorithms.eagle3.model, specforge.training.controller, triton"}
VARIANTS = {"eagle3": {"adamw", "muon"}, "speculators": {"adamw", "muon"}, "specforge": {"unwrapped", "fsdp1"}}
FIELDS = ("trainer", "step_ms", "tokens_per_s", "peak_gib", "precision", "attention", "loss_impl")


def peer_path(peer: str) -> str:
    var, default = peer_step.DEFAULT_PATHS[peer]
    return os.environ.get(var, default)


def unavailable(peer: str) -> str | None:
    """Why ``peer`` cannot be imported by its worker here (None: it can)."""
    if peer == "eagle3":
        return None
    path = os.pathsep.join(p for p in (peer_path(peer), str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    r = subprocess.run([sys.executable, "-c", PROBES[peer]], env=dict(os.environ, PYTHONPATH=path),
                       capture_output=True, text=True, timeout=600)
    if r.returncode == 0:
        return None
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    return lines[-1] if lines else f"exit code {r.returncode}"


def run_bench(args: list, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH), *args], env=dict(os.environ, OUT=str(out)),
                          capture_output=True, text=True, timeout=1800, cwd=str(REPO))


@pytest.mark.parametrize("peer", peer_step.PEERS)
def test_peer_step_trains(peer, tmp_path):
    why = unavailable(peer)
    if why:
        var = peer_step.DEFAULT_PATHS[peer][0]
        pytest.skip(f"{peer} is not importable from {var}={peer_path(peer)!r}: {why}")
    r = run_bench(["--peers", peer, *TINY], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads((tmp_path / "peer_step.json").read_text())["rows"]
    assert {row["peer"] for row in rows} == {peer}
    assert {row.get("variant") for row in rows} == VARIANTS[peer]
    for row in rows:
        if "error" in row:  # only SpecForge's FSDP1, which needs an accelerator
            assert (peer, row["variant"]) == ("specforge", "fsdp1") and "accelerator" in row["error"], row
            continue
        assert all(k in row for k in FIELDS), row
        assert row["step_ms"] > 0 and row["peak_gib"] is None  # no peak memory on CPU
        assert row["tokens_per_s"] == pytest.approx(TOKENS / (row["step_ms"] / 1e3))
        assert len(row["step_ms_all"]) == STEPS and row["step_ms"] == pytest.approx(sorted(row["step_ms_all"])[1], abs=1e-3)
        losses = row["losses"]
        assert len(losses) == WARMUP + STEPS and all(math.isfinite(x) for x in losses), losses
        assert losses[-1] < losses[0], f"{row['trainer']}: the loss did not fall on a fixed batch: {losses}"
        assert row["params_trained"] > 0 and row["params_changed"] == row["params_trained"], row
        assert row["failed"] == [], row  # on CPU each peer's row is its first (CPU) implementation
    table = r.stdout[r.stdout.index("| trainer | step ms | tokens/s | peak GiB |"):]
    for row in rows:
        assert f"| {row['trainer']} |" in table
    printed = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert [p["trainer"] for p in printed] == [row["trainer"] for row in rows]  # one JSON line per row


@pytest.mark.parametrize("peer", ["speculators", "specforge"])
def test_a_failing_default_falls_back(peer, tmp_path):
    """--try-defaults on CPU: the peer's default attention (flex, no CPU backward) fails in the
    warm-up, the row is measured with the fallback and names the failure."""
    why = unavailable(peer)
    if why:
        pytest.skip(f"{peer} is not importable from {peer_step.DEFAULT_PATHS[peer][0]}={peer_path(peer)!r}: {why}")
    r = run_bench(["--peers", peer, "--optimizers", "adamw", "--try-defaults", *TINY], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    row = json.loads((tmp_path / "peer_step.json").read_text())["rows"][0]
    assert "error" not in row, row
    assert row["failed"] and all("flex" in f and "backward" in f for f in row["failed"]), row["failed"]
    assert "(fallback)" in row["attention"] + row["loss_impl"] and row["attention"].startswith("sdpa"), row
    assert row["losses"][-1] < row["losses"][0]


@pytest.mark.skipif(importlib.util.find_spec("speculators") is not None, reason="speculators is importable here")
def test_a_failing_peer_leaves_an_error_row(tmp_path):
    """A worker that dies (here: speculators not on its path) gives an error row; the table still prints."""
    r = run_bench(["--peers", "speculators,eagle3", "--spec-path", str(tmp_path / "nothing"), *TINY], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads((tmp_path / "peer_step.json").read_text())["rows"]
    assert rows[0]["peer"] == "speculators" and "ModuleNotFoundError" in rows[0]["error"], rows[0]
    assert [row["variant"] for row in rows[1:]] == ["adamw", "muon"] and all("error" not in row for row in rows[1:])
    assert "| speculators worker | - | - | - |" in r.stdout
    merged = run_bench(["--table", str(tmp_path / "peer_step.json"), str(tmp_path / "peer_step.json")], tmp_path)
    assert merged.returncode == 0 and merged.stdout.count("| speculators worker |") == 2, merged.stdout
