"""wandb (offline, real): one run per stage job, grouped by experiment, read back from its files."""
from __future__ import annotations

from pathlib import Path

from conftest import chat_records, write_jsonl

from eagle3.manifest import Manifest
from eagle3.runner import run
from eagle3.tracking import Tracker, read_offline_run


def test_prepare_run_is_logged_offline_and_readable(compose, tiny_llama_dir, tmp_path):
    data = write_jsonl(tmp_path / "c.jsonl", chat_records(12))
    ws = tmp_path / "ws"
    run(compose("stage=prepare", f"target.path={tiny_llama_dir}", f"data.path={data}", f"workspace={ws}",
                "experiment=tracked", "prepare.draft_vocab_size=64", "progress=false"))
    runs = sorted((ws / "wandb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    logged = read_offline_run(runs[0])
    rec = Manifest(ws / "tracked").current("prepare")
    assert logged["group"] == "tracked" and logged["job_type"] == "prepare"
    assert logged["config"]["config_hash"] == rec.config_hash
    assert logged["config"]["eagle3"]["prepare"]["draft_vocab_size"] == 64
    logged_keys = {k: v for row in logged["history"] for k, v in row.items()}
    assert logged_keys["prepare/samples"] == rec.facts.num_train + rec.facts.num_eval  # statistics, by the stage
    assert logged_keys["prepare/trainable_tokens"] == rec.facts.trainable_tokens  # facts, when the job completed
    assert logged_keys["prepare/coverage"] == rec.facts.coverage
    # the coverage curve, one key per draft vocabulary size (the chosen 64 among them)
    assert logged_keys["prepare/coverage_top_64"] == rec.facts.coverage_curve["64"] == round(rec.facts.coverage, 6)
    assert logged_keys["prepare/coverage_top_4096"] == 1.0


def test_logger_jsonl_writes_no_wandb_run(compose, tiny_llama_dir, tmp_path):
    data = write_jsonl(tmp_path / "c.jsonl", chat_records(4))
    ws = tmp_path / "ws"
    run(compose("stage=prepare", f"target.path={tiny_llama_dir}", f"data.path={data}", f"workspace={ws}",
                "logger=jsonl", "prepare.draft_vocab_size=64", "progress=false"))
    assert not list(Path(ws).glob("wandb/wandb/offline-run-*"))


def test_extract_run_logged_once_and_not_on_noop(compose, tiny_llama_dir, tmp_path):
    data = write_jsonl(tmp_path / "c.jsonl", chat_records(6))
    ws = tmp_path / "ws"
    args = ("stage=extract", f"target.path={tiny_llama_dir}", f"data.path={data}", f"workspace={ws}",
            "experiment=x", "extract.backend=hf", "prepare.draft_vocab_size=64", "progress=false")
    run(compose(*args[1:], "stage=prepare", "logger=jsonl"))
    run(compose(*args))
    run(compose(*args))  # no-op: already complete, not logged again
    runs = [read_offline_run(p) for p in sorted((ws / "wandb" / "wandb").glob("offline-run-*"))]
    extract_runs = [r for r in runs if r["job_type"] == "extract"]
    assert len(extract_runs) == 1
    rec = Manifest(ws / "x").current("extract")
    assert extract_runs[0]["history"][-1]["extract/tokens_train"] == rec.facts.num_tokens["train"]


def test_export_acceptance_metric_names(compose, tmp_path):
    from eagle3.contracts import ExportFacts

    cfg = compose(f"workspace={tmp_path}", "experiment=names")
    facts = ExportFacts(format="vllm", layer_ids=[1, 2, 3], draft_vocab_size=8, vocab_size=16, dtype="float32",
                        fingerprint="f", model_dir="export/x/model", acceptance_length=2.25,
                        acceptance_by_k={"1": 1.6, "3": 2.25}, acceptance_per_position=[0.7, 0.4, 0.15])
    tracker = Tracker(cfg)
    tracker.close(tracker.open("export", "e" * 64, {}), "export", facts)
    (logged,) = [read_offline_run(p) for p in (tmp_path / "wandb" / "wandb").glob("offline-run-*")]
    row = logged["history"][-1]
    assert row["eval/acceptance_length"] == 2.25 and row["export/acceptance_length_k3"] == 2.25
    assert [row[f"export/acceptance_pos_{i}"] for i in (1, 2, 3)] == [0.7, 0.4, 0.15]
    assert row["export/acceptance_per_position/_type"] == "table-file"  # the per-position table
    assert row["export/acceptance_per_position/nrows"] == 3


def test_failed_stage_job_finishes_its_run_without_facts(compose, tmp_path):
    """A stage job that raises leaves one wandb run (finished, so a multirun's next job starts clean)
    that holds what the stage logged along the way and no facts."""
    cfg = compose(f"workspace={tmp_path}", "experiment=fails")
    m = Manifest(cfg.experiment_dir, tracker=Tracker(cfg))
    job = m.start("prepare", config={"a": 1}, target={"path": "/t", "hash": "t" * 64})
    assert job.claim() is None
    try:
        with job:
            job.log({"prepare/progress": 0.5})
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    (logged,) = [read_offline_run(p) for p in (tmp_path / "wandb" / "wandb").glob("offline-run-*")]
    keys = {k for row in logged["history"] for k in row}
    assert "prepare/progress" in keys and not any(k.startswith("prepare/num_") for k in keys)
    assert m.read()["stages"]["prepare"]["runs"][job.config_hash]["status"] == "failed"
