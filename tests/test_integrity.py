"""Integrity: a target is its content (not its file sizes), and a store's shards are their recorded digests.

Real components only: tiny random targets (tests/conftest.py), the real stages through the manifest,
the hf extraction backend (no vLLM)."""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from eagle3.config import (
    Config,
    DataConfig,
    ExportConfig,
    ExtractConfig,
    LoggerConfig,
    PrepareConfig,
    TargetConfig,
    TrainConfig,
)
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
    assert target_mod.identify(tiny_llama_dir).hash != target_mod.identify(noisy).hash  # other weights, same sizes
    cache = tmp_path / "ws" / "targets"
    a, b, c = (target_mod.identify(p, cache) for p in (tiny_llama_dir, noisy, same))
    assert a.hash != b.hash  # the same with the cache
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
                  export=ExportConfig(verify=False),
                  logger=LoggerConfig(mode="disabled"), progress=False)


def test_a_noised_copy_of_the_target_is_another_target(tmp_path, tiny_llama_dir, capsys):
    from eagle3.contracts import STAGES

    run(_cfg(tmp_path, tiny_llama_dir, "all"))  # a finished workspace
    noisy = noised_copy(tiny_llama_dir, tmp_path / "noisy")
    manifest = Manifest(tmp_path / "ws" / "t")
    old = manifest.current("extract").data["target"]

    # a stage reading the old target's runs refuses them, naming both identities and the file that differs
    with pytest.raises(ManifestError) as e:
        run(_cfg(tmp_path, noisy, "extract"))
    msg = str(e.value)
    assert old["hash"][:12] in msg and "model.safetensors" in msg and str(noisy) in msg
    assert "config.json" not in msg.split("what differs")[1]
    # stage=all runs every stage again for it (none is "already complete"); each run names the new path
    capsys.readouterr()
    run(_cfg(tmp_path, noisy, "all"))
    assert "already complete" not in capsys.readouterr().out
    for stage in STAGES:
        target = manifest.current(stage).data["target"]
        assert target["path"] == str(noisy) and target["hash"] != old["hash"], stage
    capsys.readouterr()
    run(_cfg(tmp_path, noisy, "all"))
    assert capsys.readouterr().out.count("already complete") == len(STAGES)


# -- item: the store's shards are their recorded digests ----------------------------------------

def _extracted(tmp_path, target):
    for stage in ("prepare", "extract"):
        run(_cfg(tmp_path, target, stage))
    rec = Manifest(tmp_path / "ws" / "t").current("extract")
    shards = sorted((rec.out_dir / "train").glob("shard-*.safetensors"))
    assert len(shards) >= 3
    return rec, shards


def _tensor_offset(shard: Path, name: str) -> int:
    with open(shard, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return 8 + n + header[name]["data_offsets"][0]


def _stamps(shards) -> dict:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in shards}


def test_flipped_bytes_in_a_shard_fail_train_and_extract_rebuilds_just_that_shard(tmp_path, tiny_llama_dir, capsys):
    import numpy as np

    from eagle3.hashing import sha256_tree_file
    from eagle3.store import StoreError

    rec, shards = _extracted(tmp_path, tiny_llama_dir)
    bad = shards[1]
    recorded = rec.data["outputs"][str(bad.relative_to(rec.exp_dir))]["sha256_tree"]
    size = bad.stat().st_size
    # 8 bytes of one stored state flipped in place: the file keeps its size
    at = _tensor_offset(bad, "last_hidden_state") + 4 * 64 * 3
    with open(bad, "r+b") as f:
        f.seek(at)
        before = np.frombuffer(f.read(8), dtype=np.float32).copy()
        f.seek(at)
        f.write(bytes(b ^ 0xFF for b in before.tobytes()))
    assert bad.stat().st_size == size
    others = _stamps(s for s in shards if s != bad)

    with pytest.raises(StoreError) as e:
        run(_cfg(tmp_path, tiny_llama_dir, "train"))
    msg = str(e.value)
    assert bad.name in msg and "python -m eagle3 stage=extract" in msg and recorded[:12] in msg
    manifest = Manifest(tmp_path / "ws" / "t")
    (train_run,) = manifest.read()["stages"]["train"]["runs"].values()
    assert train_run["status"] == "failed" and bad.name in train_run["error"]

    capsys.readouterr()
    run(_cfg(tmp_path, tiny_llama_dir, "extract"))
    out = capsys.readouterr().out
    assert "already complete" not in out and f"train/{bad.name}" in out and "1 shard(s)" in out
    assert _stamps(s for s in shards if s != bad) == others  # only the damaged shard was written again
    assert sha256_tree_file(bad) == recorded  # the same bytes as first written
    again = manifest.current("extract")
    assert again.status == "complete" and again.data["attempts"] == 2
    assert again.data["outputs"][str(bad.relative_to(rec.exp_dir))]["sha256_tree"] == recorded

    capsys.readouterr()
    run(_cfg(tmp_path, tiny_llama_dir, "extract"))
    assert "already complete" in capsys.readouterr().out
    run(_cfg(tmp_path, tiny_llama_dir, "train"))
    assert manifest.current("train").status == "complete"



def _extract_rebuilds(tmp_path, target, capsys, bad, full):
    """``stage=extract`` on the damaged store rewrites ``bad`` (it says so) to its original bytes."""
    capsys.readouterr()
    run(_cfg(tmp_path, target, "extract"))
    assert f"train/{bad.name}" in capsys.readouterr().out
    assert bad.read_bytes() == full


def test_a_truncated_shard_has_one_way_out_extract_rebuilds_it(tmp_path, tiny_llama_dir, capsys):
    from eagle3.store import StoreError

    rec, shards = _extracted(tmp_path, tiny_llama_dir)
    bad = shards[0]
    full = bad.read_bytes()
    bad.write_bytes(full[: len(full) // 2])
    with pytest.raises((ManifestError, StoreError)) as e:
        run(_cfg(tmp_path, tiny_llama_dir, "train"))
    assert bad.name in str(e.value) and "stage=extract" in str(e.value) and "rebuilds" in str(e.value)
    _extract_rebuilds(tmp_path, tiny_llama_dir, capsys, bad, full)


def test_a_corrupt_shard_header_names_the_file_and_extract_rebuilds_it(tmp_path, tiny_llama_dir, capsys):
    from eagle3.store import StoreError, open_hidden_states

    rec, shards = _extracted(tmp_path, tiny_llama_dir)
    bad = shards[2]
    full = bad.read_bytes()
    bad.write_bytes(full[:8] + b"#" * 16 + full[24:])  # the header's JSON broken, the size kept
    with pytest.raises(StoreError) as e:  # read without the manifest: no bare SafetensorError
        ds = open_hidden_states(rec.out_dir, "train")
        [ds[i] for i in range(len(ds))]
    assert str(bad) in str(e.value) and "`python -m eagle3 stage=extract`" in str(e.value) and "rebuilds" in str(e.value)
    with pytest.raises(StoreError) as e:
        run(_cfg(tmp_path, tiny_llama_dir, "train"))
    assert bad.name in str(e.value) and "`python -m eagle3 stage=extract`" in str(e.value) and "rebuilds" in str(e.value)
    _extract_rebuilds(tmp_path, tiny_llama_dir, capsys, bad, full)


def test_resume_writes_a_damaged_shard_again(tmp_path, tiny_llama_dir):
    """Before a run is recorded (a crashed extraction resumes), a shard that exists but is truncated
    or has a broken header is written again, not refused."""
    from eagle3.store import ShardSpec, completed_shard

    rec, shards = _extracted(tmp_path, tiny_llama_dir)
    f = rec.facts
    layout = f.layout  # what the store's shards hold, as the extract run recorded it
    assert layout.target_hash == rec.data["target"]["hash"]
    index = json.loads((rec.out_dir / "train" / "index.json").read_text())
    s0 = index["shards"][0]
    lengths = index["lengths"][s0["first_sample"]:s0["first_sample"] + s0["num_samples"]]
    spec = ShardSpec("train", 0, len(index["shards"]), 0, [range(n) for n in lengths], [range(n) for n in lengths])
    assert completed_shard(rec.out_dir / "train", spec, layout)["sha256_tree"] == s0["sha256_tree"]
    full = shards[0].read_bytes()
    shards[0].write_bytes(full[:-4])
    assert completed_shard(rec.out_dir / "train", spec, layout) is None
    shards[0].write_bytes(full[:8] + b"#" * 16 + full[24:])
    assert completed_shard(rec.out_dir / "train", spec, layout) is None


# -- item: what a train run read is what the store has ------------------------------------------

def _first_read(rec, cfg):
    """(shard path, global sample index, first row, end row) of the first sample the train loop reads."""
    from safetensors import safe_open

    from eagle3.train.data import Epochs

    index = json.loads((rec.out_dir / "train" / "index.json").read_text())
    i = Epochs(index["lengths"], cfg.train, 1).micro_batches(0, 1, 0)[0][0][0]
    shard = next(s for s in index["shards"] if s["first_sample"] <= i < s["first_sample"] + s["num_samples"])
    path = rec.out_dir / "train" / shard["file"]
    with safe_open(str(path), "pt") as f:
        off = f.get_tensor("offsets").tolist()
    j = i - shard["first_sample"]
    return path, i, off[j], off[j + 1]


def _flip_state(path: Path, row: int, hidden: int = 64) -> None:
    """8 bytes of the last hidden state at ``row`` of a float32 shard inverted in place."""
    at = _tensor_offset(path, "last_hidden_state") + 4 * hidden * row
    with open(path, "r+b") as f:
        f.seek(at)
        data = f.read(8)
        f.seek(at)
        f.write(bytes(b ^ 0xFF for b in data))


def _flip_after_verification(monkeypatch, path: Path, row: int) -> list:
    """The train stage's up-front store check runs as it is, then 8 bytes of ``path`` change: as a disk
    or another process would while the run reads the memory-mapped shard. Returns the flips done."""
    import eagle3.train_inputs as inputs_mod

    real, done = inputs_mod.verify_store, []

    def verify_then_flip(ext, progress, again=False):
        real(ext, progress, again) if again else real(ext, progress)
        if not again and not done:
            _flip_state(path, row)
            done.append(path)

    monkeypatch.setattr(inputs_mod, "verify_store", verify_then_flip)
    return done


def test_bytes_flipped_while_train_reads_the_store_fail_the_run_naming_shard_and_sample(tmp_path, tiny_llama_dir,
                                                                                       monkeypatch):
    """Digests verified before the first step, then a shard changes while the loop reads it: the read
    of the damaged sample fails the run, naming the shard and the sample; nothing is complete."""
    from eagle3.store import StoreError

    rec, _ = _extracted(tmp_path, tiny_llama_dir)
    cfg = _cfg(tmp_path, tiny_llama_dir, "train")
    path, i, a, b = _first_read(rec, cfg)
    done = _flip_after_verification(monkeypatch, path, a + 1)
    with pytest.raises(StoreError) as e:
        run(cfg)
    assert done == [path]
    msg = str(e.value)
    assert str(path) in msg and f"sample {i} (rows {a}:{b})" in msg and "python -m eagle3 stage=extract" in msg
    manifest = Manifest(tmp_path / "ws" / "t")
    (train_run,) = manifest.read()["stages"]["train"]["runs"].values()
    assert train_run["status"] == "failed" and f"sample {i}" in train_run["error"]
    assert manifest.current("train") is None  # nothing complete: export has nothing to ship
    monkeypatch.undo()
    run(_cfg(tmp_path, tiny_llama_dir, "extract"))  # the way out the message gives
    run(cfg)
    assert manifest.current("train").status == "complete"


def _strip_sample_checksums(rec) -> None:
    """The store as an eagle3 before per-sample checksums wrote it: its sidecars and indexes without
    them, and the extract run's record with those files' digests."""
    from eagle3.hashing import sha256_file

    for p in sorted(rec.out_dir.rglob("*.json")):
        data = json.loads(p.read_text())
        if p.name == "index.json":
            for s in data["shards"]:
                s.pop("sample_xxh3_64", None)
        elif p.name.startswith("shard-"):
            data.pop("sample_xxh3_64", None)
        else:
            continue
        p.write_text(json.dumps(data))

    def fix(d):
        outs = d["stages"]["extract"]["runs"][rec.config_hash]["outputs"]
        for rel, meta in outs.items():
            if rel.endswith(".json"):
                meta.update(size=(rec.exp_dir / rel).stat().st_size, sha256=sha256_file(rec.exp_dir / rel))

    Manifest(rec.exp_dir).update(fix)


def test_a_store_without_sample_checksums_is_verified_again_before_the_run_is_complete(tmp_path, tiny_llama_dir,
                                                                                       monkeypatch, caplog):
    """A store written before per-sample checksums: the run says so, and damage during the run is
    found by verifying every shard again at the end, before the run would be recorded complete."""
    from eagle3.store import StoreError

    rec, _ = _extracted(tmp_path, tiny_llama_dir)
    _strip_sample_checksums(rec)
    cfg = _cfg(tmp_path, tiny_llama_dir, "train")
    path, i, a, b = _first_read(rec, cfg)
    _flip_after_verification(monkeypatch, path, a + 1)
    with pytest.raises(StoreError) as e:
        run(cfg)
    assert "no per-sample checksums" in caplog.text
    msg = str(e.value)
    assert "at the end of this run" in msg and path.name in msg and "python -m eagle3 stage=extract" in msg
    (train_run,) = Manifest(tmp_path / "ws" / "t").read()["stages"]["train"]["runs"].values()
    assert train_run["status"] == "failed" and path.name in train_run["error"]


def _train_rerun(tmp_path, target, capsys) -> dict:
    """``stage=train`` again: not "already complete", from step 0 (no checkpoint of the earlier run left
    to resume from); returns the new record."""
    ckpts = tmp_path / "ws" / "t" / Manifest(tmp_path / "ws" / "t").current("train").data["out_dir"] / "checkpoints"
    marker = ckpts / "step-00000001"
    marker.mkdir()
    (marker / "COMPLETE").write_text("")  # a checkpoint a resumed run would load (and fail to)
    capsys.readouterr()
    run(_cfg(tmp_path, target, "train"))
    out = capsys.readouterr().out
    assert "already complete" not in out and "train: 2 steps" in out
    assert not marker.exists()
    rec = Manifest(tmp_path / "ws" / "t").current("train")
    assert rec.status == "complete"
    run(_cfg(tmp_path, target, "train"))
    assert "already complete" in capsys.readouterr().out
    return rec.data


def test_a_shard_rewritten_with_other_bytes_makes_the_train_run_stale(tmp_path, tiny_llama_dir, capsys, monkeypatch):
    """A damaged shard extracted again with other bytes (a GPU engine's numerics need not repeat
    bit for bit; here every value one ulp up): the complete train run read the old bytes, so export
    refuses it and ``stage=train`` with the same config runs it again from step 0."""
    import eagle3.extract.writer as writer_mod

    for stage in ("prepare", "extract", "train"):
        run(_cfg(tmp_path, tiny_llama_dir, stage))
    manifest = Manifest(tmp_path / "ws" / "t")
    trained = manifest.current("train")
    ext = manifest.current("extract")
    shard = sorted((ext.out_dir / "train").glob("shard-*.safetensors"))[1]
    rel = str(shard.relative_to(ext.exp_dir))
    _flip_state(shard, 3)
    real = writer_mod.store_rows

    def other_bits(aux, last, layout):
        return real(torch.nextafter(aux, aux + 1), torch.nextafter(last, last + 1), layout)

    monkeypatch.setattr(writer_mod, "store_rows", other_bits)
    capsys.readouterr()
    run(_cfg(tmp_path, tiny_llama_dir, "extract"))
    assert f"train/{shard.name}" in capsys.readouterr().out
    monkeypatch.undo()
    assert manifest.current("extract").data["outputs"][rel]["sha256_tree"] != ext.data["outputs"][rel]["sha256_tree"]

    with pytest.raises(ManifestError) as e:
        run(_cfg(tmp_path, tiny_llama_dir, "export"))
    msg = str(e.value)
    assert "stale" in msg and "written again with other content" in msg and "stage=train" in msg
    again = _train_rerun(tmp_path, tiny_llama_dir, capsys)
    assert again["config_hash"] == trained.config_hash
    assert trained.data["read"] == {"extract": ext.outputs_digest}  # what each run read, recorded
    assert again["read"] == {"extract": manifest.current("extract").outputs_digest} != trained.data["read"]
    run(_cfg(tmp_path, tiny_llama_dir, "export"))
    assert manifest.current("export").status == "complete"


def test_a_repaired_store_keeps_a_checked_train_run_and_makes_an_unchecked_one_stale(tmp_path, tiny_llama_dir, capsys):
    """A damaged shard extracted again to its very bytes: a train run that verified every sample as it
    read it read those bytes, and stays complete. A run recorded without that check (an eagle3
    before it: no ``read`` in its record) may have read the damage: it is stale, export refuses it,
    and ``stage=train`` runs it again from step 0."""
    for stage in ("prepare", "extract", "train"):
        run(_cfg(tmp_path, tiny_llama_dir, stage))
    manifest = Manifest(tmp_path / "ws" / "t")
    trained = manifest.current("train")
    shard = sorted((manifest.current("extract").out_dir / "train").glob("shard-*.safetensors"))[1]
    time.sleep(1.1)  # the manifest's times are whole seconds: the repair recorded after the train run began
    _flip_state(shard, 3)
    capsys.readouterr()
    run(_cfg(tmp_path, tiny_llama_dir, "extract"))
    assert f"train/{shard.name}" in capsys.readouterr().out
    run(_cfg(tmp_path, tiny_llama_dir, "train"))
    assert "already complete" in capsys.readouterr().out

    manifest.update(lambda d: d["stages"]["train"]["runs"][trained.config_hash].pop("read", None))
    with pytest.raises(ManifestError) as e:
        run(_cfg(tmp_path, tiny_llama_dir, "export"))
    msg = str(e.value)
    assert "stale" in msg and "was run again" in msg and "did not check what it read" in msg and "stage=train" in msg
    _train_rerun(tmp_path, tiny_llama_dir, capsys)
