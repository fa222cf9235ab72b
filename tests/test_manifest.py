"""The manifest contract: records, no-op re-runs, staleness, failures, locking."""
from __future__ import annotations

import json
import multiprocessing as mp
import re
from dataclasses import dataclass

import pytest

from eagle3.contracts import Facts
from eagle3.manifest import SCHEMA_VERSION, Manifest, ManifestError


@dataclass
class Sized(Facts):
    """Facts of the test's stage runs (any Facts subclass serialises the same way)."""

    n: int

TARGET = {"path": "/models/a", "hash": "a" * 64, "tokenizer_hash": "t" * 64}


def _run(m: Manifest, stage: str, config: dict, inputs=None, target=TARGET, fail=False, payload=b"x"):
    job = m.start(stage, config=config, target=target, inputs=inputs or {})
    if job.claim() is not None:
        return job, False
    with job:
        (job.out_dir / "out.bin").write_bytes(payload)
        job.add_output(job.out_dir / "out.bin")
        job.facts = Sized(n=len(payload))
        if fail:
            raise RuntimeError("boom")
    return job, True


def test_complete_record_has_contract_fields(tmp_path):
    m = Manifest(tmp_path / "exp")
    job, ran = _run(m, "prepare", {"a": 1})
    assert ran
    data = json.loads(m.path.read_text())
    assert data["schema_version"] == SCHEMA_VERSION == 3
    rec = data["stages"]["prepare"]["runs"][job.config_hash]
    assert rec["status"] == "complete" and rec["target"] == TARGET
    assert rec["facts"] == {"n": 1} and rec["started"] and rec["ended"]
    (rel, meta), = rec["outputs"].items()
    assert meta["size"] == 1 and len(meta["sha256"]) == 64 and rel.startswith(f"prepare/{job.config_hash[:12]}/")
    assert "python" in rec["versions"]


def test_same_config_is_noop_and_other_config_reruns(tmp_path):
    m = Manifest(tmp_path / "exp")
    j1, ran1 = _run(m, "prepare", {"a": 1})
    j2, ran2 = _run(m, "prepare", {"a": 1})
    j3, ran3 = _run(m, "prepare", {"a": 2})
    assert (ran1, ran2, ran3) == (True, False, True)
    assert j1.config_hash == j2.config_hash != j3.config_hash
    assert m.current("prepare").config_hash == j3.config_hash


def test_deleted_output_makes_rerun(tmp_path):
    m = Manifest(tmp_path / "exp")
    j1, _ = _run(m, "prepare", {"a": 1})
    (j1.out_dir / "out.bin").unlink()
    _, ran = _run(m, "prepare", {"a": 1})
    assert ran


def test_downstream_refuses_stale_upstream(tmp_path, caplog):
    m = Manifest(tmp_path / "exp")
    _run(m, "prepare", {"a": 1})
    prep = m.consume("prepare", by="extract", target_hash=TARGET["hash"])
    _run(m, "extract", {"b": 1}, inputs={"prepare": prep})
    assert m.consume("extract", by="train").status == "complete"
    with caplog.at_level("WARNING", logger="eagle3.manifest"):
        _run(m, "prepare", {"a": 2})  # upstream changes
    assert "stage prepare now has a new output" in caplog.text and "extract are stale" in caplog.text
    fresh = Manifest(m.exp_dir)
    with pytest.raises(ManifestError, match="stale.*'prepare' was re-run"):
        fresh.consume("extract", by="train")


def test_missing_upstream_names_the_command(tmp_path):
    with pytest.raises(ManifestError, match="stage=prepare"):
        Manifest(tmp_path / "exp").consume("prepare", by="extract")


def test_other_target_is_refused(tmp_path):
    m = Manifest(tmp_path / "exp")
    _run(m, "prepare", {"a": 1})
    with pytest.raises(ManifestError, match="produced for target '/models/a'"):
        m.consume("prepare", by="extract", target_hash="b" * 64)


def test_failed_run_keeps_previous_current(tmp_path):
    m = Manifest(tmp_path / "exp")
    good, _ = _run(m, "prepare", {"a": 1})
    with pytest.raises(RuntimeError):
        _run(m, "prepare", {"a": 2}, fail=True)
    data = m.read()["stages"]["prepare"]
    assert data["current"] == good.config_hash
    assert data["runs"][data["latest"]]["status"] == "failed"
    assert "boom" in data["runs"][data["latest"]]["error"]
    assert m.consume("prepare", by="extract").config_hash == good.config_hash


def test_changed_output_size_is_refused(tmp_path):
    m = Manifest(tmp_path / "exp")
    job, _ = _run(m, "prepare", {"a": 1})
    (job.out_dir / "out.bin").write_bytes(b"longer")
    with pytest.raises(ManifestError, match="missing or changed size"):
        m.consume("prepare", by="extract")


def test_concurrent_identical_run_is_refused_without_wait(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE3_NO_WAIT", "1")
    m = Manifest(tmp_path / "exp")
    job = m.start("prepare", config={"a": 1}, target=TARGET)
    with job:
        other = Manifest(m.exp_dir).start("prepare", config={"a": 1}, target=TARGET)
        with pytest.raises(ManifestError, match="another process is running"):
            other.claim()
        job.facts = Sized(n=0)


def _slow_job(exp_dir, log_path):
    import time

    m = Manifest(exp_dir)
    job = m.start("prepare", config={"a": 1}, target=TARGET)
    if job.claim() is not None:
        open(log_path, "a").write("skipped\n")
        return
    with job:
        time.sleep(1.0)
        (job.out_dir / "out.bin").write_bytes(b"x")
        job.add_output(job.out_dir / "out.bin")
        job.facts = Sized(n=1)
    open(log_path, "a").write("ran\n")


def test_two_processes_with_same_config_compute_once(tmp_path):
    ctx = mp.get_context("spawn")
    log_path = tmp_path / "log.txt"
    procs = [ctx.Process(target=_slow_job, args=(tmp_path / "exp", log_path)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert sorted(log_path.read_text().split()) == ["ran", "skipped"]


def _hammer(exp_dir, k):
    m = Manifest(exp_dir)
    for i in range(25):
        m.update(lambda d, i=i: d.setdefault("counters", {}).__setitem__(f"{k}-{i}", i))


def test_updates_from_processes_do_not_interleave(tmp_path):
    exp = tmp_path / "exp"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_hammer, args=(exp, k)) for k in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    data = json.loads((exp / "manifest.json").read_text())
    assert len(data["counters"]) == 75


def test_foreign_schema_version_is_refused(tmp_path):
    exp = tmp_path / "exp"
    exp.mkdir()
    (exp / "manifest.json").write_text(json.dumps({"schema_version": 99, "stages": {}}))
    with pytest.raises(ManifestError, match="schema_version 99"):
        Manifest(exp).read()


def test_stage_without_facts_is_recorded_failed(tmp_path):
    """A stage that forgets its facts is a bug: the run is never marked complete."""
    m = Manifest(tmp_path / "exp")
    job = m.start("prepare", config={"a": 1}, target=TARGET)
    with pytest.raises(RuntimeError, match="without recording its facts"):
        with job:
            pass
    assert m.read()["stages"]["prepare"]["runs"][job.config_hash]["status"] == "failed"
    assert m.current("prepare") is None


def test_version_1_manifest_is_read_and_upgraded(tmp_path):
    """A manifest written by eagle3 before the typed contracts (schema 1: the train metrics as flat
    lists, the draft's file names among the facts) is read, its runs stay current, and the next
    update writes schema 2."""
    from eagle3.contracts import TrainFacts

    exp = tmp_path / "exp"
    (exp / "train" / "abc").mkdir(parents=True)
    (exp / "train" / "abc" / "draft.safetensors").write_bytes(b"w")
    v1_train = {"steps": 12, "ttt_steps": 2, "layer_ids": [1, 2, 3], "draft_vocab_size": 200,
                "draft_file": "draft.safetensors", "metrics_file": "metrics.jsonl",
                "train_loss": 3.5, "train_loss_per_step": [2.0, 1.875], "train_acc_per_step": [0.25, 0.125],
                "train_accept_len": [1.25, 1.28125],
                "eval_loss": 3.25, "eval_loss_per_step": [1.75, 1.875], "eval_acc_per_step": [0.5, 0.25],
                "eval_cond_acc_per_step": [0.5, 0.5], "eval_accept_len": [1.5, 1.75]}
    run = {"status": "complete", "config_hash": "abc" * 21 + "a", "config": {}, "upstream": {}, "target": TARGET,
           "out_dir": "train/abc", "facts": v1_train, "started": "2026-11-01T00:00:00+00:00",
           "ended": "2026-11-01T00:01:00+00:00",
           "outputs": {"train/abc/draft.safetensors": {"size": 1, "sha256": "0" * 64}}}
    (exp / "manifest.json").write_text(json.dumps({"schema_version": 1, "experiment": "exp", "stages": {
        "train": {"current": run["config_hash"], "latest": run["config_hash"], "runs": {run["config_hash"]: run}}}}))
    m = Manifest(exp)
    facts = m.current("train").facts
    assert isinstance(facts, TrainFacts) and facts.steps == 12 and facts.layer_ids == [1, 2, 3]
    assert facts.eval.loss == 3.25 and facts.eval.acc_per_step == [0.5, 0.25] and facts.eval.accept_len == [1.5, 1.75]
    assert facts.train.loss == 3.5 and facts.train.loss_per_step == [2.0, 1.875]
    assert facts.final is facts.eval
    m.update(lambda d: None)
    data = json.loads((exp / "manifest.json").read_text())
    assert data["schema_version"] == SCHEMA_VERSION
    assert data["stages"]["train"]["runs"][run["config_hash"]]["facts"]["eval"]["loss"] == 3.25


def test_consumer_reads_the_run_of_its_config_not_only_the_current_one(tmp_path, caplog):
    """`stage=export train.seed=0` after seed 1 was trained: the export reads seed 0's train run; for a
    config no run was made with it reads the current run and warns with the difference and the command."""
    m = Manifest(tmp_path / "exp")
    _run(m, "prepare", {"a": 1})
    prep = m.consume("prepare", by="extract")
    _run(m, "extract", {"extract": {"dtype": "bf16"}}, inputs={"prepare": prep})
    ext = m.consume("extract", by="train", wanted={"dtype": "bf16"})
    seed0, _ = _run(m, "train", {"train": {"seed": 0, "lr": 1e-3}}, inputs={"prepare": prep, "extract": ext})
    seed1, _ = _run(m, "train", {"train": {"seed": 1, "lr": 1e-3}}, inputs={"prepare": prep, "extract": ext})
    m = Manifest(m.exp_dir)  # another process (`stage=export`): nothing pinned
    assert m.consume("train", by="export").config_hash == seed1.config_hash  # no config given: the current run
    assert m.consume("train", by="export", wanted={"seed": 1, "lr": 1e-3}).config_hash == seed1.config_hash
    assert m.consume("train", by="export", wanted={"seed": 0, "lr": 1e-3}).config_hash == seed0.config_hash
    with caplog.at_level("WARNING", logger="eagle3.manifest"):
        assert m.consume("train", by="export", wanted={"seed": 2, "lr": 1e-3}).config_hash == seed1.config_hash
    assert re.search(r"current train run .*train\.seed=1 \(this config: 2\).*stage=train", caplog.text)
    m.pins["train"] = seed1.config_hash  # a run this process made (stage=all) is taken as is
    assert m.consume("train", by="export", wanted={"seed": 0, "lr": 1e-3}).config_hash == seed1.config_hash


def test_a_stale_run_of_the_config_is_not_taken(tmp_path):
    m = Manifest(tmp_path / "exp")
    _run(m, "prepare", {"a": 1})
    prep = m.consume("prepare", by="extract")
    _run(m, "extract", {"extract": {"dtype": "bf16"}}, inputs={"prepare": prep})
    _run(m, "train", {"train": {"seed": 0}}, inputs={"prepare": prep, "extract": m.consume("extract", by="train")})
    bf16 = m.current("extract")
    _run(m, "extract", {"extract": {"dtype": "fp8"}}, inputs={"prepare": prep})  # current extract changes
    ext = Manifest(m.exp_dir).consume("extract", by="train")
    _run(m, "train", {"train": {"seed": 1}}, inputs={"prepare": prep, "extract": ext})
    current = Manifest(m.exp_dir).consume("train", by="export")
    on = {"fp8": {"prepare": prep.config_hash, "extract": ext.config_hash},
          "bf16": {"prepare": prep.config_hash, "extract": bf16.config_hash}}
    # seed 0's run was trained on the bf16 store: not taken for a config that names the fp8 one (the
    # current run is, with a warning) ...
    assert Manifest(m.exp_dir).consume("train", by="export", wanted={"seed": 0},
                                       lineage=on["fp8"]).config_hash == current.config_hash
    # ... and taken for one that names the bf16 store, which is still there as it was read
    seed0 = Manifest(m.exp_dir).consume("train", by="export", wanted={"seed": 0}, lineage=on["bf16"])
    assert seed0.config_hash != current.config_hash and seed0.data["upstream"]["extract"] == bf16.config_hash
    # once that store's shards are written again (other bytes), the run trained on it is stale
    (bf16.out_dir / "out.bin").unlink()
    _, ran = _run(m, "extract", {"extract": {"dtype": "bf16"}}, inputs={"prepare": prep}, payload=b"yy")
    assert ran  # written again, other bytes
    assert Manifest(m.exp_dir).consume("train", by="export", wanted={"seed": 0},
                                       lineage=on["bf16"]).config_hash == current.config_hash


def test_config_section_is_what_the_train_and_extract_runs_record():
    from eagle3.__main__ import compose_config
    from eagle3.hashing import semantic_dict
    from eagle3.manifest import config_section

    cfg = compose_config(["train.seed=3", "extract.store_dtype=fp8"])
    assert config_section(cfg, "train") == json.loads(json.dumps(semantic_dict(cfg.train)))
    assert config_section(cfg, "train")["seed"] == 3 and config_section(cfg, "extract")["store_dtype"] == "fp8"
    assert config_section(cfg, "prepare") is None  # read as the current run


def test_one_train_config_on_two_extract_runs_export_reads_the_draft_of_its_own_lineage(tmp_path, caplog):
    """The default layers and extract.layer_ids=auto arms side by side: one prepare, two extract runs,
    the same train.* on each. `stage=export` with either arm's overrides ships the draft trained on that
    arm's extract run (the train section alone matches both; the latest one used to be taken)."""
    from eagle3.__main__ import compose_config
    from eagle3.manifest import config_section

    m = Manifest(tmp_path / "exp")
    _run(m, "prepare", {"a": 1})
    prep = m.consume("prepare", by="extract")
    cfgs = {name: compose_config([f"extract.layer_ids={ids}"]) for name, ids in (("a", "[1,2,3]"), ("b", "auto"))}
    trains = {}
    for name, cfg in cfgs.items():
        with caplog.at_level("WARNING", logger="eagle3.manifest"):
            ext, _ = _run(m, "extract", {"extract": config_section(cfg, "extract")}, inputs={"prepare": prep})
        assert "stale" not in caplog.text  # arm a's draft stays valid beside arm b's store
        ext_rec = m.consume("extract", by="train", wanted=config_section(cfg, "extract"))
        assert ext_rec.config_hash == ext.config_hash
        trains[name], _ = _run(m, "train", {"train": config_section(cfg, "train")},
                               inputs={"prepare": prep, "extract": ext_rec})
    assert trains["a"].config_hash != trains["b"].config_hash  # same section, other upstream
    for name in ("a", "b"):  # b ran last: its draft is the current one; a must still get its own
        got = Manifest(m.exp_dir).consume_upstream("export", TARGET["hash"], cfg=cfgs[name])
        assert got["train"].config_hash == trains[name].config_hash
        assert got["train"].data["upstream"]["extract"] == got["extract"].config_hash


def _hold_extract(exp_dir, started, seconds, complete):
    """An extract run in another process: its run lock held for ``seconds``, then complete or failed."""
    import time

    m = Manifest(exp_dir)
    job = m.start("extract", config={"extract": {"x": 1}}, target=TARGET)
    assert job.claim() is None
    with job:
        open(started, "w").write("running\n")
        time.sleep(seconds)
        (job.out_dir / "out.bin").write_bytes(b"x")
        job.add_output(job.out_dir / "out.bin")
        job.facts = Sized(n=1)
        if not complete:
            raise RuntimeError("extraction stopped")


def _start_holder(tmp_path, seconds, complete=True):
    import time

    started = tmp_path / "started"
    proc = mp.get_context("spawn").Process(target=_hold_extract,
                                           args=(tmp_path / "exp", started, seconds, complete))
    proc.start()
    deadline = time.time() + 60
    while not started.exists() and time.time() < deadline:
        time.sleep(0.05)
    assert started.exists()
    return proc


def test_an_upstream_run_in_progress_is_named_and_waited_for(tmp_path, monkeypatch):
    """`stage=train` while extract runs in another process used to say extract "has not been run".
    It waits for the run (as claim() waits for one of its own config) and reads it once complete;
    with EAGLE3_NO_WAIT it refuses, naming the run and its process."""
    proc = _start_holder(tmp_path, seconds=2.0)
    m = Manifest(tmp_path / "exp")
    monkeypatch.setenv("EAGLE3_NO_WAIT", "1")
    with pytest.raises(ManifestError, match=r"stage 'train' needs stage 'extract', whose run \w{12} is running now "
                                            rf"\(pid {proc.pid} on .*: wait for it to finish, or stop it"):
        m.consume("extract", by="train", wanted={"x": 1})
    monkeypatch.delenv("EAGLE3_NO_WAIT")
    rec = m.consume("extract", by="train", wanted={"x": 1})  # waits
    assert rec.status == "complete" and rec.data["facts"] == {"n": 1}
    proc.join(30)


def test_status_shows_what_an_unfinished_run_holds_on_disk(tmp_path):
    """A run records its outputs only when it completes: stage=status showed a failed or interrupted
    one as holding "0 B", though its directory held what it had written (checkpoints, shards)."""
    from eagle3.report import status_rows

    m = Manifest(tmp_path / "exp")
    with pytest.raises(RuntimeError):
        _run(m, "prepare", {"a": 1}, fail=True, payload=b"x" * 3000)  # the only run: failed, 3000 B written
    (row,) = [r for r in status_rows(m) if r["stage"] == "prepare"]
    assert row["status"] == "failed" and row["size"] == "2.9 KiB on disk", row


def test_an_upstream_run_that_failed_or_was_killed_says_so(tmp_path):
    proc = _start_holder(tmp_path, seconds=1.0, complete=False)
    m = Manifest(tmp_path / "exp")
    with pytest.raises(ManifestError, match=r"has no complete run in .*: its last run \w{12} failed "
                                            r"\(RuntimeError: extraction stopped\)"):
        m.consume("extract", by="train", wanted={"x": 1})  # waits, then reads the failure
    proc.join(30)
    m.update(lambda d: d["stages"]["extract"]["runs"][d["stages"]["extract"]["latest"]].update(status="running"))
    with pytest.raises(ManifestError, match=r"was stopped before it ended \(recorded as running by pid"):
        m.consume("extract", by="train", wanted={"x": 1})


def _hold_extract_of(overrides, started):
    """The extract run of this config, its run lock held by this process (the extraction itself
    is not what is tested: the state another process sees while it runs)."""
    import time

    from eagle3.__main__ import compose_config
    from eagle3.hashing import semantic_dict
    from eagle3.target import resolve

    cfg = compose_config(overrides)
    m = Manifest(cfg.experiment_dir)
    target = resolve(cfg.target, cfg.workspace)
    job = m.start("extract", config={"extract": semantic_dict(cfg.extract)}, target=target.identity(),
                  inputs=m.consume_upstream("extract", target.hash))
    assert job.claim() is None
    with job:
        open(started, "w").write("running\n")
        time.sleep(120)


def test_cli_train_while_extract_runs_says_it_is_running(tmp_path, tiny_llama_dir):
    import os
    import subprocess
    import sys
    import time

    from conftest import chat_records, write_jsonl

    data = write_jsonl(tmp_path / "c.jsonl", chat_records(8))
    overrides = [f"target.path={tiny_llama_dir}", f"data.path={data}", f"workspace={tmp_path}/ws", "logger=jsonl",
                 "progress=false", "prepare.draft_vocab_size=64"]
    cli = [sys.executable, "-m", "eagle3", *overrides]
    assert subprocess.run([*cli, "stage=prepare"], capture_output=True, timeout=300).returncode == 0
    started = tmp_path / "started"
    holder = mp.get_context("spawn").Process(target=_hold_extract_of, args=(overrides, started))
    holder.start()
    try:
        deadline = time.time() + 120
        while not started.exists() and time.time() < deadline:
            time.sleep(0.1)
        out = subprocess.run([*cli, "stage=train"], capture_output=True, text=True, timeout=300,
                             env={**os.environ, "EAGLE3_NO_WAIT": "1"})
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
        assert re.search(rf"eagle3: error: stage 'train' needs stage 'extract', whose run \w{{12}} is running now "
                         rf"\(pid {holder.pid} on ", out.stderr), out.stderr
        assert "has not been run" not in out.stderr
    finally:
        holder.kill()
        holder.join(30)


def test_the_job_announces_a_complete_run_once(tmp_path, capsys):
    m = Manifest(tmp_path / "exp")
    _run(m, "prepare", {"a": 1})
    assert "already complete" not in capsys.readouterr().out
    job, ran = _run(m, "prepare", {"a": 1})
    assert not ran and capsys.readouterr().out == f"prepare: already complete ({job.config_hash[:12]}), nothing to do\n"


def test_other_ranks_of_a_launch_run_the_work_and_record_nothing(tmp_path, monkeypatch):
    """job.across_ranks(): a rank other than 0 takes no lock (rank 0 holds it) and records nothing;
    once rank 0 recorded the run, every rank finds it complete."""
    monkeypatch.setenv("EAGLE3_NO_WAIT", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")  # a launch of two processes (a launcher sets both, RANK below)
    m = Manifest(tmp_path / "exp")
    main = m.start("prepare", config={"a": 1}, target=TARGET).across_ranks()
    assert main.claim() is None  # rank 0 holds the run lock from here
    monkeypatch.setenv("RANK", "1")
    other = Manifest(m.exp_dir).start("prepare", config={"a": 1}, target=TARGET).across_ranks()
    assert not other.is_main and other.claim() is None  # no "another process is running"
    with other:
        other.facts = Sized(n=1)
    assert other.record is None and Manifest(m.exp_dir).record("prepare", other.config_hash) is None
    monkeypatch.setenv("RANK", "0")
    with main:
        (main.out_dir / "out.bin").write_bytes(b"x")
        main.add_output(main.out_dir / "out.bin")
        main.facts = Sized(n=1)
    monkeypatch.setenv("RANK", "1")
    again = Manifest(m.exp_dir).start("prepare", config={"a": 1}, target=TARGET).across_ranks()
    assert again.claim().status == "complete"
    # a damaged output: rank 0 runs the stage again, and so does every other rank (before, they took
    # the run as complete and left rank 0 alone in the run's collectives)
    (main.out_dir / "out.bin").write_bytes(b"y")
    for rank in ("1", "0"):
        monkeypatch.setenv("RANK", rank)
        job = Manifest(m.exp_dir).start("prepare", config={"a": 1}, target=TARGET).across_ranks()
        rel = str(main.out_dir.relative_to(m.exp_dir) / "out.bin")
        assert job.claim(digests=True) is None and [d.rel for d in job.damaged] == [rel], job.damaged
        if rank == "0":
            job._run_lock.release()


def test_a_run_in_parts_is_recorded_by_the_last_part_to_finish(tmp_path):
    from types import SimpleNamespace

    m = Manifest(tmp_path / "exp")
    done: set = set()

    def work(parts, part):
        (m.exp_dir / f"{part}.bin").parent.mkdir(parents=True, exist_ok=True)
        done.add(part)
        return SimpleNamespace(complete=len(done) == parts, missing=[p for p in range(parts) if p not in done])

    def finish(result):
        jobs[-1].facts = Sized(n=len(done))

    jobs = [m.start("prepare", config={"a": 1}, target=TARGET)]
    assert jobs[0].claim() is None and jobs[0].run_parts(work, finish, part=1, parts=2) is None
    assert m.current("prepare") is None  # one part of two: nothing recorded
    jobs.pop()  # that process ends (its run lock with it)
    jobs.append(Manifest(m.exp_dir).start("prepare", config={"a": 1}, target=TARGET))
    assert jobs[0].claim() is None
    rec = jobs[0].run_parts(work, finish, part=0, parts=2)
    assert rec.status == "complete" and rec.data["facts"] == {"n": 2}


def test_schema_2_extract_facts_read_as_one_layout(tmp_path):
    """An extract run of schema version 2 (its layout as separate facts) reads as one StoreLayout, as
    the store it describes holds it; written back, the facts carry the layout whole."""
    from eagle3.contracts import ExtractFacts
    from eagle3.store import StoreLayout

    exp = tmp_path / "exp"
    exp.mkdir()
    v2_extract = {"layer_ids": [1, 2, 3], "last_layer_id": 4, "hidden_size": 64, "store_dtype": "bfloat16",
                  "target_dtype": "bfloat16", "backend": "hf", "store_format": "eagle3.hidden_states/1",
                  "bytes_per_token": 517, "num_samples": {"train": 2}, "num_tokens": {"train": 9}}
    run = {"status": "complete", "config_hash": "e" * 64, "config": {}, "upstream": {}, "target": TARGET,
           "out_dir": "extract/e", "facts": v2_extract, "started": "2026-11-01T00:00:00+00:00",
           "ended": "2026-11-01T00:01:00+00:00", "outputs": {}}
    (exp / "manifest.json").write_text(json.dumps({"schema_version": 2, "experiment": "exp", "stages": {
        "extract": {"current": run["config_hash"], "latest": run["config_hash"], "runs": {run["config_hash"]: run}}}}))
    m = Manifest(exp)
    facts = m.record("extract", "e" * 64).facts
    assert isinstance(facts, ExtractFacts) and facts.backend == "hf" and facts.num_tokens == {"train": 9}
    assert facts.layout == StoreLayout(layer_ids=(1, 2, 3), last_layer_id=4, hidden_size=64, dtype="bfloat16")
    assert facts.layout.bytes_per_token == 517  # the recorded figure follows from the layout
    m.update(lambda d: None)
    data = json.loads((exp / "manifest.json").read_text())
    assert data["schema_version"] == SCHEMA_VERSION == 3
    assert data["stages"]["extract"]["runs"]["e" * 64]["facts"]["layout"] == {
        "layer_ids": [1, 2, 3], "last_layer_id": 4, "hidden_size": 64, "dtype": "bfloat16", "target_hash": ""}
    assert "store_dtype" not in data["stages"]["extract"]["runs"]["e" * 64]["facts"]
