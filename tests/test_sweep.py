"""Hydra multirun: shared upstream, outputs kept apart, a ranking table; a bad swept value refused
before any job runs; a failing job reported, the others run, the sweep exits 1; the submitit local
launcher (the SLURM code path on this machine)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import chat_records, write_jsonl


def _cli(*args, timeout=900):
    out = subprocess.run([sys.executable, "-m", "eagle3", *args], capture_output=True, text=True, timeout=timeout)
    return out


@pytest.fixture(scope="module")
def extracted(tiny_llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sweep")
    data = write_jsonl(tmp / "c.jsonl", chat_records(24))
    common = [f"target.path={tiny_llama_dir}", f"data.path={data}", f"workspace={tmp / 'ws'}", "experiment=sw",
              "logger=jsonl", "progress=false", "prepare.draft_vocab_size=128"]
    for stage in ("prepare", "extract"):
        out = _cli(f"stage={stage}", "extract.backend=hf", *common)
        assert out.returncode == 0, out.stderr[-2000:]
    return tmp, common


def test_train_sweep_shares_upstream_and_ranks_the_jobs(extracted):
    tmp, common = extracted
    manifest_path = tmp / "ws" / "sw" / "manifest.json"
    before = set(json.loads(manifest_path.read_text())["stages"].get("train", {}).get("runs", {}))
    out = _cli("-m", "stage=train", "extract.backend=hf", "train.max_steps=2", "train.eval_every=2",
               "train.warmup_steps=1", "train.ttt_steps=2", "train.lr=1e-3,3e-3", *common)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout + out.stderr
    stages = json.loads(manifest_path.read_text())["stages"]
    assert len(stages["prepare"]["runs"]) == 1 and len(stages["extract"]["runs"]) == 1  # computed once
    # only this sweep's runs (the module's other tests may have trained in the same experiment first)
    train_runs = {h: r for h, r in stages["train"]["runs"].items() if h not in before}
    assert len(train_runs) == 2 and all(r["status"] == "complete" for r in train_runs.values())
    assert len({r["out_dir"] for r in train_runs.values()}) == 2  # kept apart by config hash
    assert "2 jobs, 0 failed" in " ".join(text.split()) and "train.lr" in text
    assert "rank" in text and "eval loss" in text


@pytest.mark.parametrize("values", ["train.lr=1e-3,bad", "train.grad_clip=-1,1.0"])
def test_a_bad_swept_value_is_refused_before_any_job(tmp_path, values):
    """A value Hydra cannot merge and one the schema refuses alike: every job's config is checked
    before any job runs; the refusal names the key and the value; nothing is created."""
    key, _, vals = values.partition("=")
    bad = vals.split(",")[1 if "bad" in vals else 0]
    out = _cli("-m", "stage=status", f"workspace={tmp_path / 'ws'}", values, timeout=120)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert f"{key}={bad} (job #" in out.stderr and "none ran" in out.stderr, out.stderr
    assert "Launching" not in out.stdout + out.stderr and not (tmp_path / "ws").exists()


@pytest.mark.parametrize("launcher", ["basic", "submitit"])
def test_a_failed_job_fails_the_sweep_after_the_others_ran(tmp_path, launcher):
    """One job fails at run time (its experiment's manifest is damaged), the next one runs, the
    table is printed, and the sweep exits 1 naming the failed job; for submitit too, whose jobs end
    in other processes."""
    ws = tmp_path / "ws"
    (ws / "bad").mkdir(parents=True)
    (ws / "bad" / "manifest.json").write_text("{not json")
    extra = ["hydra/launcher=local"] if launcher == "submitit" else []
    out = _cli("-m", *extra, "stage=status", f"workspace={ws}", "experiment=bad,good", timeout=300)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    text = " ".join(out.stdout.split())  # the table's title wraps at its width
    assert "2 jobs, 1 failed" in text and "failed job: name=bad" in text, out.stdout[-3000:]
    assert "eagle3: 1 of 2 jobs of the sweep failed: name=bad" in out.stderr, out.stderr[-3000:]
    ok = _cli("-m", *extra, "stage=status", f"workspace={ws}", "experiment=good,other", timeout=300)
    assert ok.returncode == 0 and "2 jobs, 0 failed" in " ".join(ok.stdout.split()), ok.stdout[-2000:] + ok.stderr


def test_submitit_local_launcher_runs_a_job(extracted):
    tmp, common = extracted
    out = _cli("-m", "hydra/launcher=local", "stage=status", *common, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    logs = list((tmp / "ws" / "sw" / "logs").glob("multirun_*/.submitit/*/*_0_log.out"))
    assert logs and "prepare" in logs[0].read_text()


def test_optuna_sweeper_optimises_eval_loss(extracted):
    tmp, common = extracted
    out = _cli("-m", "hydra/sweeper=optuna_train", "hydra.sweeper.n_trials=2", "stage=train", "objective=eval_loss",
               "train.max_steps=2", "train.eval_every=2", "train.warmup_steps=1", *common)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout + out.stderr
    assert "Best value" in text or "best_value" in text
    best = sorted((tmp / "ws" / "sw" / "logs").glob("multirun_*/optimization_results.yaml"))
    assert best and "best_value" in best[-1].read_text()
