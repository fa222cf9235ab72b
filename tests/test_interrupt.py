"""Stopping a run: SIGTERM mid-training saves a checkpoint and a re-run resumes from it; a run whose
process is gone (SIGKILL) is shown as interrupted, never running; a disk that fills while a
checkpoint is written leaves the previous checkpoint usable. Real stages on a tiny real target,
training in a real subprocess where a signal is sent."""
from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """prepare + extract (hf backend) done; ``overrides`` of the train runs, ``cli`` runs a stage."""
    from conftest import build_tiny_llama, chat_records, write_jsonl

    from eagle3.__main__ import compose_config
    from eagle3.runner import run

    root = tmp_path_factory.mktemp("interrupt")
    target = build_tiny_llama(root / "target")
    data = write_jsonl(root / "chats.jsonl", chat_records(40))
    common = [f"target.path={target}", f"data.path={data}", f"workspace={root / 'ws'}", "experiment=stop",
              "logger=jsonl", "progress=false", "prepare.draft_vocab_size=128", "extract.backend=hf",
              "extract.device=cpu", "train.ttt_steps=2", "train.warmup_steps=2", "train.lr=1e-3",
              "train.log_every=1", "train.eval_every=100000", "train.max_seq_len=128", "cpu_threads=1"]
    for stage in ("prepare", "extract"):
        run(compose_config([f"stage={stage}", *common]))
    return {"root": root, "common": common, "exp": root / "ws" / "stop"}


def _popen(pipeline, *overrides):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    # its own process group: signals go to every process of it, as a scheduler sends them
    return subprocess.Popen([sys.executable, "-m", "eagle3", "stage=train", *pipeline["common"], *overrides],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _runs(pipeline) -> dict:
    from eagle3.manifest import Manifest

    return Manifest(pipeline["exp"]).read()["stages"].get("train", {}).get("runs", {})


def _train_dir(pipeline, proc, before: dict) -> Path:
    """The directory of the train run the subprocess started (a run not in ``before``, or one that
    was not running then), once it is recorded as running."""
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        for chash, r in _runs(pipeline).items():
            old = before.get(chash)
            if r["status"] == "running" and (old is None or old["started"] != r["started"]):
                return pipeline["exp"] / r["out_dir"]
        time.sleep(0.05)
    raise AssertionError(f"the train run did not start: {proc.communicate()}")


def _wait_for_steps(out_dir: Path, proc, n: int) -> None:
    deadline = time.time() + 300
    m = out_dir / "metrics.jsonl"
    while time.time() < deadline and proc.poll() is None:
        if m.exists() and len(m.read_text().splitlines()) >= n:
            return
        time.sleep(0.01)
    raise AssertionError(f"the run ended before {n} steps: {proc.communicate()}")


def _children(pid: int) -> list:
    """The processes ``pid`` started (Linux /proc)."""
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _train_steps(out_dir: Path) -> list:
    return [r["step"] for r in map(json.loads, (out_dir / "metrics.jsonl").read_text().splitlines())
            if "train/loss" in r]


def _train_row(pipeline):
    from eagle3.manifest import Manifest
    from eagle3.report import status_rows

    return next(r for r in status_rows(Manifest(pipeline["exp"])) if r["stage"] == "train")


@pytest.mark.parametrize("workers", [0, 1])
def test_sigterm_mid_train_saves_a_checkpoint_and_a_rerun_resumes_from_it(pipeline, caplog, workers):
    """With the default train.save_every (500) no checkpoint would exist before step 500: SIGTERM
    (to every process of the job, DataLoader workers too; twice) makes the loop finish its step, save one,
    and exit 143 saying how to resume; the re-run of the same command continues from that step and
    logs every step once."""
    from eagle3.__main__ import compose_config
    from eagle3.manifest import Manifest
    from eagle3.runner import run

    overrides = ["train.max_steps=400", f"train.num_workers={workers}", f"train.seed={10 + workers}"]
    before = _runs(pipeline)
    proc = _popen(pipeline, *overrides)
    out_dir = _train_dir(pipeline, proc, before)
    _wait_for_steps(out_dir, proc, 5)
    os.killpg(proc.pid, signal.SIGTERM)
    time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGTERM)  # one stop often comes twice (scheduler and launcher): still one checkpoint
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, (stdout[-2000:], stderr[-3000:])
    assert "interrupted by SIGTERM at step" in stderr and "Run the same command again to resume" in stderr, stderr[-3000:]
    ckpts = sorted(p.name for p in (out_dir / "checkpoints").glob("step-*") if (p / "COMPLETE").exists())
    assert len(ckpts) == 1, ckpts
    step = int(ckpts[0].split("-")[1])
    assert 5 <= step < 400 and _train_steps(out_dir) == list(range(1, step + 1))
    assert not (out_dir / "draft.safetensors").exists()
    rec = Manifest(pipeline["exp"]).record("train", Manifest(pipeline["exp"]).read()["stages"]["train"]["latest"])
    assert rec.status == "interrupted" and "SIGTERM" in rec.data["error"]
    row = _train_row(pipeline)
    # the stage's current run is this one (the first test) or the complete one of another (then in the note)
    assert row["status"] == "interrupted" or f"latest run {out_dir.name} is interrupted" in row["note"], row
    assert f"last checkpoint {ckpts[0]}" in row["note"], row

    caplog.set_level(logging.INFO, logger="eagle3.train")
    run(compose_config(["stage=train", *pipeline["common"], *overrides]))
    assert f"resumed from {ckpts[0]} (step {step} of 400)" in caplog.text
    assert _train_steps(out_dir) == list(range(1, 401))
    rec = Manifest(pipeline["exp"]).current("train")
    assert rec.status == "complete" and rec.facts.steps == 400 and rec.out_dir == out_dir


def test_a_run_killed_with_sigkill_shows_as_interrupted(pipeline, capsys):
    """Nothing runs on SIGKILL: the manifest still says running, but the run lock is free, so
    stage=status shows the run interrupted (with how to resume) instead of running forever."""
    from eagle3.__main__ import compose_config
    from eagle3.runner import run

    before = _runs(pipeline)
    proc = _popen(pipeline, "train.max_steps=400", "train.seed=1")
    out_dir = _train_dir(pipeline, proc, before)
    _wait_for_steps(out_dir, proc, 3)
    latest = f"latest run {out_dir.name}"  # the current train run is the complete one of the test above
    assert f"{latest} is running" in _train_row(pipeline)["note"]  # its process holds the lock
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    row = _train_row(pipeline)
    assert f"{latest} is interrupted" in row["note"], row
    assert f"pid {proc.pid}" in row["note"] and "stage=train` with the same overrides to resume" in row["note"]
    capsys.readouterr()
    run(compose_config(["stage=status", *pipeline["common"]]))
    table = capsys.readouterr().out
    assert "interrupted" in table and "running" not in table


def test_full_disk_while_checkpointing_keeps_the_previous_checkpoint(pipeline, monkeypatch, caplog):
    """The second checkpoint's write fails with ENOSPC part-way (the writer patched in this process
    only): an error naming the directory, the bytes needed and free; no step-4 directory, whole or
    partial; step 2 stays whole (with the umask's file modes), and the re-run resumes from it."""
    import accelerate.checkpointing

    from eagle3.__main__ import compose_config
    from eagle3.manifest import Manifest
    from eagle3.runner import run
    from eagle3.train.checkpoint import CheckpointError

    real_save = accelerate.checkpointing.save

    def save_until_full(obj, f, *args, **kw):
        if "step-00000004" in str(f):
            Path(f).write_bytes(b"\0" * 100)
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        return real_save(obj, f, *args, **kw)

    overrides = ["stage=train", *pipeline["common"], "train.max_steps=6", "train.save_every=2", "train.seed=2"]
    monkeypatch.setattr(accelerate.checkpointing, "save", save_until_full)
    old_mask = os.umask(0o022)
    try:
        with pytest.raises(CheckpointError) as e:
            run(compose_config(overrides))
    finally:
        os.umask(old_mask)
    monkeypatch.undo()
    m = Manifest(pipeline["exp"])
    rec = m.record("train", m.read()["stages"]["train"]["latest"])
    ckpt_dir = rec.out_dir / "checkpoints"
    msg = str(e.value)
    assert f"checkpoint of step 4 in {ckpt_dir}" in msg and "bytes" in msg and "are free there" in msg, msg
    assert f"{ckpt_dir / 'step-00000002'} is intact" in msg, msg
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["step-00000002"]
    assert (ckpt_dir / "step-00000002" / "COMPLETE").exists()
    modes = {p.name: p.stat().st_mode & 0o777 for p in (ckpt_dir / "step-00000002").iterdir()}
    assert modes and set(modes.values()) == {0o644}, modes  # model.safetensors included
    assert rec.status == "failed"

    caplog.set_level(logging.INFO, logger="eagle3.train")
    run(compose_config(overrides))
    assert "resumed from step-00000002 (step 2 of 6)" in caplog.text
    assert _train_steps(rec.out_dir) == [1, 2, 3, 4, 5, 6]
    assert m.current("train").status == "complete"


def test_sigterm_in_another_stage_records_it_interrupted(pipeline):
    """Outside the train loop SIGTERM ends the stage as Ctrl-C does (here prepare, regenerating
    with transformers): the run is recorded interrupted, the command exits 143 saying how to go on."""
    from eagle3.manifest import Manifest

    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    common = [o.replace("experiment=stop", "experiment=stop_prepare") for o in pipeline["common"]]
    proc = subprocess.Popen([sys.executable, "-m", "eagle3", "stage=prepare", *common, "prepare.regenerate=true",
                             "prepare.regen.backend=hf", "prepare.regen.max_tokens=3000"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    exp = pipeline["root"] / "ws" / "stop_prepare"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        runs = Manifest(exp).read()["stages"].get("prepare", {}).get("runs", {})
        if any(r["status"] == "running" for r in runs.values()):
            break
        time.sleep(0.05)
    time.sleep(1.0)  # into the regeneration
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, (stdout[-2000:], stderr[-3000:])
    assert "interrupted by SIGTERM" in stderr and "Run the same command again" in stderr, stderr[-2000:]
    (rec,) = Manifest(exp).read()["stages"]["prepare"]["runs"].values()
    assert rec["status"] == "interrupted"


def test_sigterm_under_torchrun_stops_every_rank_at_one_checkpoint(pipeline):
    """Two processes (torchrun, gloo; as `accelerate launch` on GPUs): every process of the job is
    signalled, as a scheduler does (torchrun starts each rank in a session of its own, so a signal
    to torchrun's group alone would not reach them), and torchrun forwards SIGTERM once more; the
    ranks agree on one step at a logged step, save one checkpoint and stop; the same launch again
    resumes from it."""
    from eagle3.manifest import Manifest

    # torchrun kills ranks still running 30 s after it forwards the signal: seconds are enough here,
    # but a loaded machine's stalled disk (the checkpoint's fsync) must not make the test fail
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               ACCELERATE_USE_CPU="1", TORCH_ELASTIC_SHUTDOWN_TIMEOUT="240")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29571",
           "-m", "eagle3", "stage=train", *pipeline["common"], "train.max_steps=300", "train.log_every=3",
           "train.seed=20", "train.batch_size=1"]
    before = _runs(pipeline)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    out_dir = _train_dir(pipeline, proc, before)
    _wait_for_steps(out_dir, proc, 3)
    ranks = _children(proc.pid)
    assert len(ranks) == 2, ranks
    for pgid in {os.getpgid(pid) for pid in ranks} | {proc.pid}:
        os.killpg(pgid, signal.SIGTERM)
    t_signal = time.monotonic()
    stdout, stderr = proc.communicate(timeout=300)
    took = time.monotonic() - t_signal
    # on a failure, what the ranks and torchrun said, not the tail of their warnings
    said = [ln for ln in stderr.splitlines() if any(k in ln for k in ("eagle3", "Error", "signal", "Signal", "rank"))]
    if not (proc.returncode != 0 and "interrupted by SIGTERM at step" in stderr):
        pytest.fail(f"exit {proc.returncode} {took:.1f} s after the signal; what the ranks and torchrun said:\n"
                    + "\n".join(said[-60:]),
                    pytrace=False)
    ckpts = sorted(p.name for p in (out_dir / "checkpoints").glob("step-*") if (p / "COMPLETE").exists())
    assert len(ckpts) == 1 and int(ckpts[0].split("-")[1]) % 3 == 0, ckpts
    m = Manifest(pipeline["exp"])
    assert m.record("train", m.read()["stages"]["train"]["latest"]).status == "interrupted"
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert _train_steps(out_dir) == list(range(3, 301, 3))
    assert m.current("train").out_dir == out_dir and m.current("train").status == "complete"

