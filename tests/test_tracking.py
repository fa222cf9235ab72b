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
