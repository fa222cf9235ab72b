"""wandb (offline, real): one run per stage job, grouped by experiment, read back from its files."""
from __future__ import annotations

from pathlib import Path

from conftest import chat_records, write_jsonl
from eagle3.cli import run
from eagle3.manifest import Manifest
from eagle3.tracking import read_offline_run


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
    last = logged["history"][-1]
    assert last["prepare/samples"] == rec.facts["num_train"] + rec.facts["num_eval"]
    assert last["prepare/trainable_tokens"] == rec.facts["trainable_tokens"]


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
    assert extract_runs[0]["history"][-1]["extract/tokens_train"] == rec.facts["num_tokens"]["train"]


def test_export_acceptance_metric_names(compose, tmp_path):
    from eagle3.manifest import StageRecord
    from eagle3.tracking import log_stage_facts

    cfg = compose(f"workspace={tmp_path}", "experiment=names")
    facts = {"acceptance_length": 2.25, "acceptance_by_k": {"1": 1.6, "3": 2.25},
             "acceptance_per_position": [0.7, 0.4, 0.15]}
    rec = StageRecord("export", {"config_hash": "e" * 64, "facts": facts, "upstream": {}}, tmp_path)
    log_stage_facts(cfg, "export", rec)
    (logged,) = [read_offline_run(p) for p in (tmp_path / "wandb" / "wandb").glob("offline-run-*")]
    row = logged["history"][-1]
    assert row["eval/acceptance_length"] == 2.25 and row["export/acceptance_length_k3"] == 2.25
    assert [row[f"export/acceptance_pos_{i}"] for i in (1, 2, 3)] == [0.7, 0.4, 0.15]
    assert row["export/acceptance_per_position/_type"] == "table-file"  # the per-position table
    assert row["export/acceptance_per_position/nrows"] == 3
