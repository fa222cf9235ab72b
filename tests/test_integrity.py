"""Integrity: a target is its content (not its file sizes), and a store's shards are their recorded digests.

Real components only: tiny random targets (tests/conftest.py), the real stages through the manifest,
the hf extraction backend (no vLLM)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from eagle3.config import Config, DataConfig, ExtractConfig, LoggerConfig, PrepareConfig, TargetConfig, TrainConfig
from eagle3.manifest import Manifest, ManifestError
from eagle3.runner import run


def noised_copy(src: Path, dst: Path, scale: float = 1e-3) -> Path:
    """A copy of a checkpoint with noise added to every weight: the same shapes, the same file sizes."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    path = dst / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(str(path))
    g = torch.Generator().manual_seed(1)
    noised = {k: t + scale * torch.randn(t.shape, generator=g, dtype=t.dtype) for k, t in tensors.items()}
    save_file(noised, str(path), metadata=meta)
    assert path.stat().st_size == (src / "model.safetensors").stat().st_size
    return dst


# -- item: the target's identity ----------------------------------------------------------------

def test_identity_follows_the_weights_not_the_path_and_is_cached(tmp_path, tiny_llama_dir, monkeypatch):
    import eagle3.target as target_mod
    from eagle3.hashing import sha256_tree_file

    noisy = noised_copy(tiny_llama_dir, tmp_path / "noisy")
    same = shutil.copytree(tiny_llama_dir, tmp_path / "same")
    cache = tmp_path / "ws" / "targets"
    a, b, c = (target_mod.identify(p, cache) for p in (tiny_llama_dir, noisy, same))
    assert a.hash != b.hash  # same shapes and sizes, other weights: another target
    assert a.hash == c.hash and a.path != c.path  # the same bytes elsewhere: the same target
    assert a.files["model.safetensors"] == sha256_tree_file(tiny_llama_dir / "model.safetensors")
    assert "model.safetensors" in target_mod.identity_diff(a.identity(), b.identity())
    assert "config.json" not in target_mod.identity_diff(a.identity(), b.identity())

    # a second identification reads no weight file (the cache under the workspace answers) ...
    reads = []
    real = target_mod.sha256_tree_files
    monkeypatch.setattr(target_mod, "sha256_tree_files", lambda files, **kw: reads.append(files) or real(files, **kw))
    assert target_mod.identify(noisy, cache).hash == b.hash and reads == []
    assert str(noisy / "model.safetensors") in json.loads((cache / target_mod.DIGEST_CACHE).read_text())
    # ... until the file changes, even with its size and mtime put back
    w = noisy / "model.safetensors"
    st = w.stat()
    data = bytearray(w.read_bytes())
    data[-8:] = bytes(8)
    w.write_bytes(bytes(data))
    import os

    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert w.stat().st_size == st.st_size and w.stat().st_mtime_ns == st.st_mtime_ns
    assert target_mod.identify(noisy, cache).hash not in (a.hash, b.hash) and len(reads) == 1


def _cfg(tmp_path, target: Path, stage: str, **train) -> Config:
    from conftest import chat_records, write_jsonl

    data = tmp_path / "chats.jsonl"
    if not data.exists():
        write_jsonl(data, chat_records(24))
    return Config(stage=stage, workspace=str(tmp_path / "ws"), name="t", target=TargetConfig(path=str(target)),
                  data=DataConfig(path=str(data)), prepare=PrepareConfig(max_length=128, draft_vocab_size=128),
                  extract=ExtractConfig(backend="hf", device="cpu", layer_ids=[1, 2, 3], samples_per_shard=8),
                  train=TrainConfig(max_steps=2, ttt_steps=2, log_every=1, eval_every=2, save_every=2, warmup_steps=1,
                                    lr=1e-3, max_seq_len=128, **train),
                  logger=LoggerConfig(mode="disabled"), progress=False)


def test_a_noised_copy_of_the_target_is_another_target(tmp_path, tiny_llama_dir, capsys):
    for stage in ("prepare", "extract"):
        run(_cfg(tmp_path, tiny_llama_dir, stage))
    noisy = noised_copy(tiny_llama_dir, tmp_path / "noisy")
    manifest = Manifest(tmp_path / "ws" / "t")
    old = manifest.current("extract").data["target"]

    # a stage reading the old target's runs refuses them, naming both identities and the file that differs
    with pytest.raises(ManifestError) as e:
        run(_cfg(tmp_path, noisy, "extract"))
    msg = str(e.value)
    assert old["hash"][:12] in msg and "model.safetensors" in msg and str(noisy) in msg
    assert "config.json" not in msg.split("what differs")[1]
    # the first stage is run again for it (not "already complete"), and its run names the new path
    capsys.readouterr()
    run(_cfg(tmp_path, noisy, "prepare"))
    assert "already complete" not in capsys.readouterr().out
    assert manifest.current("prepare").data["target"]["path"] == str(noisy)
    assert manifest.current("prepare").data["target"]["hash"] != old["hash"]
