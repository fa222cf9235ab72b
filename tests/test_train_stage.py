"""stage=train through the manifest: prepare -> extract (hf backend) -> train on a tiny real target."""
from __future__ import annotations

import json

import pytest
import torch

from eagle3.artifacts import DRAFT_CONFIG_FILE, DRAFT_FILE, VLLM_CONFIG_FILE
from eagle3.config import Config, DataConfig, ExtractConfig, LoggerConfig, PrepareConfig, TargetConfig, TrainConfig
from eagle3.manifest import Manifest
from eagle3.model.draft import Eagle3Draft, Eagle3DraftConfig
from eagle3.runner import run


def test_train_stage_records_draft_metrics_and_facts(tmp_path, tiny_llama_dir, capsys):
    from conftest import chat_records, write_jsonl
    from safetensors.torch import load_file

    cfg = Config(stage="prepare", workspace=str(tmp_path / "ws"), name="t", target=TargetConfig(path=str(tiny_llama_dir)),
                 data=DataConfig(path=str(write_jsonl(tmp_path / "chats.jsonl", chat_records(40)))),
                 prepare=PrepareConfig(max_length=128, draft_vocab_size=200),
                 extract=ExtractConfig(backend="hf", device="cpu", layer_ids=[1, 2, 3]),
                 train=TrainConfig(max_steps=12, ttt_steps=3, log_every=4, eval_every=6, save_every=6, warmup_steps=2,
                                   lr=3e-3, max_seq_len=256),
                 logger=LoggerConfig(mode="offline", dir=str(tmp_path / "wandb")), progress=False)
    for stage in ("prepare", "extract", "train"):
        cfg.stage = stage
        run(cfg)
    manifest = Manifest(tmp_path / "ws" / "t")
    rec = manifest.current("train")
    assert rec.status == "complete"
    f = rec.facts
    assert f.steps == 12 and f.layer_ids == [1, 2, 3] and f.draft_vocab_size == 200
    assert len(f.eval.acc_per_step) == 3 and len(f.eval.accept_len) == 3 and len(f.train.loss_per_step) == 3
    assert 1.0 <= f.eval.accept_len[0] <= f.eval.accept_len[-1] <= 4.0

    # the draft: vLLM names, loads strictly into the model its config describes, vocab from prepare
    dcfg = Eagle3DraftConfig.from_dict(json.loads(rec.path(DRAFT_CONFIG_FILE).read_text()))
    tensors = load_file(str(rec.path(DRAFT_FILE)))
    draft = Eagle3Draft(dcfg)
    draft.load_state_dict(tensors, strict=True)
    prep_vocab = load_file(str(manifest.current("prepare").path("vocab.safetensors")))
    assert torch.equal(tensors["d2t"], prep_vocab["d2t"]) and torch.equal(tensors["t2d"], prep_vocab["t2d"])
    vllm_cfg = json.loads(rec.path(VLLM_CONFIG_FILE).read_text())
    assert vllm_cfg["architectures"] == ["LlamaForCausalLMEagle3"] and vllm_cfg["num_aux_hidden_states"] == 3

    lines = [json.loads(x) for x in rec.path("metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "train/loss" in r] == [4, 8, 12]
    assert [r["step"] for r in lines if "eval/loss" in r] == [6, 12]
    assert all(r["lr"] > 0 and r["tokens_per_s"] > 0 for r in lines if "train/loss" in r)
    assert sorted(p.name for p in (rec.out_dir / "checkpoints").iterdir()) == ["step-00000006", "step-00000012"]
    # one wandb run per stage job; the train job's holds the curve (the same numbers as
    # metrics.jsonl, at the same steps) and, last, its facts
    from eagle3.tracking import read_offline_run

    runs = [read_offline_run(p.parent) for p in (tmp_path / "wandb").rglob("run-*.wandb")]
    assert sorted(r["job_type"] for r in runs) == ["extract", "prepare", "train"]
    (train_run,) = [r for r in runs if r["job_type"] == "train"]
    curve = [row for row in train_run["history"] if "train/loss" in row and "lr" in row]
    assert [row["_step"] for row in curve] == [4, 8, 12]
    assert [row["train/loss"] for row in curve] == [r["train/loss"] for r in lines if "train/loss" in r]
    assert [row["_step"] for row in train_run["history"] if "eval/loss" in row] == [6, 12]
    assert train_run["history"][-1]["train/steps"] == 12
    assert train_run["config"]["config_hash"] == rec.config_hash

    capsys.readouterr()
    run(cfg)  # same config: nothing to do
    assert "already complete" in capsys.readouterr().out


@pytest.mark.parametrize("nproc", [2, 8])
def test_train_stage_under_several_processes(tiny_llama_dir, tmp_path, nproc):
    """The stage launched on several processes (`accelerate launch -m eagle3 stage=train`; here torchrun
    with ACCELERATE_USE_CPU, the variable `accelerate launch --cpu` sets: gloo): the main process records
    one complete run with one metrics stream, and the draft is the one a single process trains on
    the same global batch (N x 1 row against 1 x N rows). With 8 processes, as on an 8-GPU host, the
    held-out split (1 sample of 24) is smaller than the number of ranks."""
    import os
    import subprocess
    import sys

    from conftest import chat_records, write_jsonl
    from safetensors.torch import load_file

    data = write_jsonl(tmp_path / "c.jsonl", chat_records(24))
    common = [f"target.path={tiny_llama_dir}", f"data.path={data}", f"workspace={tmp_path / 'ws'}", "experiment=mp",
              "logger=jsonl", "progress=false", "prepare.draft_vocab_size=128", "extract.backend=hf",
              "train.max_steps=3", "train.ttt_steps=2", "train.warmup_steps=1", "train.lr=1e-3", "train.log_every=1",
              "train.eval_every=3", "train.max_seq_len=128"]
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def cli(*args, launcher=()):
        out = subprocess.run([sys.executable, *launcher, "-m", "eagle3", *args, *common], capture_output=True,
                             text=True, timeout=900, env=env)
        assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-3000:])
        return out

    for stage in ("prepare", "extract"):
        cli(f"stage={stage}")
    cli("stage=train", f"train.batch_size={nproc}")
    env["ACCELERATE_USE_CPU"] = "1"
    cli("stage=train", "train.batch_size=1",
        launcher=("-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(29539 + nproc)))
    manifest = json.loads((tmp_path / "ws" / "mp" / "manifest.json").read_text())
    (prep,) = manifest["stages"]["prepare"]["runs"].values()
    assert prep["facts"]["num_eval"] < 2 <= nproc  # some ranks hold no held-out sample
    runs = manifest["stages"]["train"]["runs"]
    assert len(runs) == 2 and all(r["status"] == "complete" for r in runs.values())
    one, two = (Manifest(tmp_path / "ws" / "mp").record("train", h) for h in runs)
    if one.data["config"]["train"]["batch_size"] != nproc:
        one, two = two, one
    for rec in (one, two):  # one line per step and one eval: nothing written twice
        lines = [json.loads(x) for x in (rec.out_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in lines if "train/loss" in r] == [1, 2, 3]
        assert [r["step"] for r in lines if "eval/loss" in r] == [3]
    a, b = (load_file(str(r.out_dir / "draft.safetensors")) for r in (one, two))
    assert max((a[k] - b[k]).abs().max().item() for k in a if a[k].is_floating_point()) < 1e-5
