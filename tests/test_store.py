"""The hidden-state store: shard format, writer (any chunk order, coverage, full disk), reader, layer ids."""
from __future__ import annotations

import errno
import json
import random

import numpy as np
import pytest
import torch

from eagle3.extract.layers import LayerIdError, default_layer_ids, resolve_layer_ids, resolve_store_dtype
from eagle3.extract.writer import CapturedBatch, ShardWriter
from eagle3.hashing import sha256_tree_file
from eagle3.store import (
    ShardSpec,
    StoreError,
    StoreLayout,
    StoreWriteError,
    completed_shard,
    finalize_store,
    open_hidden_states,
    shard_header,
    shard_name,
    shard_ranges,
)

H = 16
LAYOUT = StoreLayout(layer_ids=(1, 2, 4), last_layer_id=6, hidden_size=H, dtype="float32", target_hash="t" * 64)


def _samples(n=11, seed=0, max_len=40):
    rng = random.Random(seed)
    lengths = [rng.randint(1, max_len) for _ in range(n)]
    lengths[3] = 0  # an empty sample is legal in the store
    ids = [[rng.randrange(1000) for _ in range(t)] for t in lengths]
    mask = [[rng.randrange(2) for _ in range(t)] for t in lengths]
    # Deterministic "hidden states" per (sample, position, layer): what any backend would produce.
    states = [torch.randn(t, LAYOUT.n_aux + 1, H, generator=torch.Generator().manual_seed(100 + i))
              for i, t in enumerate(lengths)]
    return ids, mask, states


def _write_store(store_dir, ids, mask, states, layout=LAYOUT, sps=4, chunk_seed=0, splits=("train",), **writer_kw):
    """Write every shard with chunks of random sizes in a random order, like interleaved prefill steps."""
    rng = random.Random(chunk_seed)
    writer = ShardWriter(store_dir, layout, **writer_kw)
    for split in splits:
        ranges = shard_ranges(len(ids), sps)
        for k, (first, count) in enumerate(ranges):
            spec = ShardSpec(split, k, len(ranges), first, ids[first:first + count], mask[first:first + count])
            writer.begin(spec)
            chunks = []
            for j in range(count):
                t, pos = len(ids[first + j]), 0
                while pos < t:
                    n = rng.randint(1, 7)
                    chunks.append((j, pos, min(n, t - pos)))
                    pos += n
            # chunks of one sample arrive in order (as prefill does); samples interleave at random
            by_sample = {}
            for c in chunks:
                by_sample.setdefault(c[0], []).append(c)
            queues = list(by_sample.values())
            while queues:
                q = rng.choice(queues)
                j, pos, n = q.pop(0)
                if not q:
                    queues.remove(q)
                s = states[first + j][pos:pos + n]
                writer.write(CapturedBatch([((split, k), j, pos, 0, n)], list(s[:, :-1].unbind(1)), s[:, -1]))
            writer.end((split, k))
    done = writer.close()
    finalize_store(store_dir, layout, {s: [len(x) for x in ids] for s in splits}, sps)
    return done


def _files(d):
    return {p.relative_to(d): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file() and not p.name.startswith(".")}


def test_roundtrip_exact_and_lazy_reader(tmp_path):
    ids, mask, states = _samples()
    done = _write_store(tmp_path / "s", ids, mask, states, splits=("train", "eval"))
    assert len(done) == 2 * len(shard_ranges(len(ids), 4))
    hs = open_hidden_states(tmp_path / "s", "train")
    assert len(hs) == len(ids) and hs.layer_ids == (1, 2, 4) and hs.last_layer_id == 6 and hs.hidden_size == H
    assert list(hs.lengths) == [len(x) for x in ids]
    for i in [*range(len(ids)), -1]:
        item = hs[i]
        i = i % len(ids)
        assert item["input_ids"].dtype == torch.int64 and item["input_ids"].tolist() == ids[i]
        assert item["loss_mask"].dtype == torch.bool and item["loss_mask"].int().tolist() == mask[i]
        assert item["aux_hidden_states"].shape == (len(ids[i]), 3, H)
        assert torch.equal(item["aux_hidden_states"], states[i][:, :-1])
        assert torch.equal(item["last_hidden_state"], states[i][:, -1])
    with pytest.raises(IndexError):
        hs[len(ids)]
    # the files are ordinary safetensors
    from safetensors import safe_open

    with safe_open(str(tmp_path / "s" / "train" / "shard-00000-of-00003.safetensors"), "pt") as f:
        assert f.metadata()["layer_ids"] == "1,2,4"
        assert f.get_tensor("offsets").tolist() == [0, *np.cumsum([len(x) for x in ids[:4]]).tolist()]


def test_bytes_do_not_depend_on_chunking_or_order(tmp_path):
    ids, mask, states = _samples()
    _write_store(tmp_path / "a", ids, mask, states, chunk_seed=1)
    _write_store(tmp_path / "b", ids, mask, states, chunk_seed=2)
    a, b = _files(tmp_path / "a"), _files(tmp_path / "b")
    assert a.keys() == b.keys() and all(a[k] == b[k] for k in a)
    side = json.loads((tmp_path / "a" / "train" / "shard-00001-of-00003.json").read_text())
    side_path = next(k for k in a if k.name == side["file"])
    assert side["sha256_tree"] == sha256_tree_file(tmp_path / "a" / "train" / side["file"], side["tree_chunk"])
    assert side_path.name == "shard-00001-of-00003.safetensors"


def test_sha256_tree_is_sha256_over_the_leaves_sha256(tmp_path):
    """The shard digest's definition: leaves of ``chunk`` bytes (the last shorter), each sha256'd,
    the root the sha256 of their concatenated digests; any changed byte changes it."""
    import hashlib

    data = np.random.default_rng(0).integers(0, 256, 10_000, dtype=np.uint8).tobytes()
    f = tmp_path / "blob"
    f.write_bytes(data)
    leaves = b"".join(hashlib.sha256(data[i:i + 4096]).digest() for i in range(0, len(data), 4096))
    assert sha256_tree_file(f, 4096) == hashlib.sha256(leaves).hexdigest()
    assert sha256_tree_file(f) == hashlib.sha256(hashlib.sha256(data).digest()).hexdigest()  # one 16 MiB leaf
    f.write_bytes(data[:5000] + bytes([data[5000] ^ 1]) + data[5001:])
    assert sha256_tree_file(f, 4096) != hashlib.sha256(leaves).hexdigest()


def _sidecars_match_files(d):
    sides = sorted(d.rglob("shard-*.json"))
    assert sides
    for side in sides:
        rec = json.loads(side.read_text())
        assert rec["sha256_tree"] == sha256_tree_file(side.parent / rec["file"], rec["tree_chunk"]), side


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pipelined_writer_writes_the_bytes_of_the_plain_writer(tmp_path, monkeypatch, dtype):
    """Hashing while writing (rows out of order, many small pieces on several row threads, hash reads
    in small chunks) and early writeback give the files and sidecars of the plain writer (one row
    thread, shard flushed and then read back to hash it)."""
    import eagle3.extract.writer as writer_mod

    monkeypatch.setattr(writer_mod, "_PIECE", 200)  # pieces of a few rows: many per chunk, finishing in any order
    monkeypatch.setattr(writer_mod, "_HASH_CHUNK", 1000)
    layout = StoreLayout(layer_ids=(1, 2, 4), last_layer_id=6, hidden_size=H, dtype=dtype)
    ids, mask, states = _samples(n=13, max_len=60)
    reads = []
    real = writer_mod._hash_file
    monkeypatch.setattr(writer_mod, "_hash_file", lambda fd, size, *rest: reads.append(size) or real(fd, size, *rest))
    _write_store(tmp_path / "plain", ids, mask, states, layout=layout, chunk_seed=3, stream_hash=False,
                 early_writeback=False, row_threads=1)
    assert len(reads) == 4  # every shard read back after its fsync
    _write_store(tmp_path / "piped", ids, mask, states, layout=layout, chunk_seed=4)
    assert len(reads) == 4  # every shard hashed while written: nothing read back at the end
    a, b = _files(tmp_path / "plain"), _files(tmp_path / "piped")
    assert a.keys() == b.keys() and all(a[k] == b[k] for k in a)
    _sidecars_match_files(tmp_path / "piped")


def test_rows_written_twice_hash_the_final_file(tmp_path, monkeypatch):
    """Rows sent again with other values (a recomputed chunk): the file holds the last values and
    the sidecar's digest is that file's, though leaves may have been hashed with the first ones."""
    import eagle3.extract.writer as writer_mod

    reads = []
    real = writer_mod._hash_file
    monkeypatch.setattr(writer_mod, "_hash_file", lambda fd, size, *rest: reads.append(size) or real(fd, size, *rest))
    ids, mask = [[1] * 6, [2] * 3], [[1] * 6, [0] * 3]
    x, y, z = torch.randn(6, 4, H), torch.randn(6, 4, H), torch.randn(3, 4, H)
    w = ShardWriter(tmp_path, LAYOUT)
    w.begin(ShardSpec("train", 0, 1, 0, ids, mask))
    w.write(CapturedBatch([(("train", 0), 0, 0, 0, 6)], x[:, :3], x[:, 3]))
    w.write(CapturedBatch([(("train", 0), 0, 2, 2, 6)], y[:, :3], y[:, 3]))  # rows 2..5 of sample 0 again
    w.write(CapturedBatch([(("train", 0), 1, 0, 0, 3)], z[:, :3], z[:, 3]))
    w.end(("train", 0))
    w.close()
    assert len(reads) == 1  # the streamed hash was dropped: the final file was hashed
    _sidecars_match_files(tmp_path)
    finalize_store(tmp_path, LAYOUT, {"train": [6, 3]}, 256)
    got = open_hidden_states(tmp_path)[0]["aux_hidden_states"]
    assert torch.equal(got[:2], x[:2, :3]) and torch.equal(got[2:], y[2:, :3])


def test_bfloat16_store(tmp_path):
    layout = StoreLayout(layer_ids=(0, 3), last_layer_id=6, hidden_size=H, dtype="bfloat16")
    ids, mask = [[1, 2, 3], [4]], [[0, 1, 1], [1]]
    states = [torch.randn(3, 3, H), torch.randn(1, 3, H)]
    w = ShardWriter(tmp_path, layout)
    w.begin(ShardSpec("train", 0, 1, 0, ids, mask))
    w.write(CapturedBatch([(("train", 0), 0, 0, 0, 3), (("train", 0), 1, 0, 3, 4)],
                          torch.cat(states)[:, :2], torch.cat(states)[:, 2]))
    w.end(("train", 0))
    w.close()
    finalize_store(tmp_path, layout, {"train": [3, 1]}, 256)
    hs = open_hidden_states(tmp_path)
    assert hs[0]["aux_hidden_states"].dtype == torch.bfloat16
    assert torch.equal(hs[1]["last_hidden_state"], states[1][:, 2].to(torch.bfloat16))
    assert layout.bytes_per_token == 3 * H * 2 + 5


def test_incomplete_capture_leaves_no_shard(tmp_path):
    ids, mask = [[1, 2, 3, 4], [5, 6]], [[1] * 4, [1] * 2]
    w = ShardWriter(tmp_path, LAYOUT)
    w.begin(ShardSpec("train", 0, 1, 0, ids, mask))
    x = torch.zeros(2, 4, H)
    w.write(CapturedBatch([(("train", 0), 0, 0, 0, 2)], x[:, :3], x[:, 3]))  # sample 0: 2 of 4 tokens
    w.end(("train", 0))
    with pytest.raises(StoreWriteError, match="incomplete"):
        w.close()
    assert not list((tmp_path / "train").glob("*"))  # neither shard, sidecar nor temp file


def test_gap_in_positions_is_refused(tmp_path):
    w = ShardWriter(tmp_path, LAYOUT)
    w.begin(ShardSpec("train", 0, 1, 0, [[1] * 8], [[1] * 8]))
    x = torch.zeros(2, 4, H)
    w.write(CapturedBatch([(("train", 0), 0, 3, 0, 2)], x[:, :3], x[:, 3]))  # starts at 3, nothing before
    with pytest.raises(StoreWriteError, match="gap"):
        w.close()


def test_full_disk_is_a_clear_error_and_leaves_nothing(tmp_path, monkeypatch):
    import eagle3.extract.writer as writer_mod

    real = writer_mod.os.pwrite
    budget = {"n": 0}

    def pwrite(fd, data, offset):  # the disk fills up after a few writes
        budget["n"] += 1
        if budget["n"] > 8:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(writer_mod.os, "pwrite", pwrite)
    ids, mask, states = _samples()
    with pytest.raises(StoreWriteError, match="disk full"):
        _write_store(tmp_path / "s", ids, mask, states)
    left = [p for p in (tmp_path / "s").rglob("*") if p.is_file()]
    assert all(p.suffix == ".json" or p.name.endswith(".safetensors") for p in left)
    # whatever shard exists is complete (written before the disk filled); no store.json claims completion
    assert not (tmp_path / "s" / "store.json").exists()
    for p in left:
        if p.name.endswith(".safetensors"):
            side = json.loads(p.with_suffix(".json").read_text())
            assert sha256_tree_file(p, side["tree_chunk"]) == side["sha256_tree"]


def test_resume_check_refuses_foreign_shards(tmp_path):
    ids, mask, states = _samples()
    _write_store(tmp_path / "s", ids, mask, states)
    spec = ShardSpec("train", 0, 3, 0, ids[:4], mask[:4])
    assert completed_shard(tmp_path / "s" / "train", spec, LAYOUT)["sha256_tree"]
    other = StoreLayout(layer_ids=(1, 2, 4), last_layer_id=6, hidden_size=H, dtype="float32", target_hash="u" * 64)
    with pytest.raises(StoreError, match="another extraction"):
        completed_shard(tmp_path / "s" / "train", spec, other)


def test_reader_errors(tmp_path):
    ids, mask, states = _samples()
    _write_store(tmp_path / "s", ids, mask, states)
    with pytest.raises(StoreError, match="split 'eval'"):
        open_hidden_states(tmp_path / "s", "eval")
    shard = tmp_path / "s" / "train" / "shard-00002-of-00003.safetensors"
    with open(shard, "ab") as f:
        f.write(b"x")
    with pytest.raises(StoreError, match="changed size"):
        open_hidden_states(tmp_path / "s")
    (tmp_path / "s" / "store.json").unlink()
    with pytest.raises(StoreError, match="not a complete"):
        open_hidden_states(tmp_path / "s")
    with pytest.raises(StoreError, match="neither"):
        open_hidden_states(tmp_path / "nothing")


def _flip(path, offset: int, n: int = 1) -> None:
    """``n`` bytes of a file inverted in place (its size kept), as a disk or a stray write would."""
    with open(path, "r+b") as f:
        f.seek(offset)
        data = f.read(n)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))


@pytest.mark.parametrize("tensor", ["aux_hidden_states", "last_hidden_state", "input_ids", "loss_mask", "offsets"])
def test_every_sample_is_verified_as_it_is_read(tmp_path, tensor):
    """Bytes changed after the reader opened a shard (it is memory-mapped) fail the read of the sample
    they belong to, naming the shard and the sample; the other samples read on."""
    ids, mask, states = _samples()
    _write_store(tmp_path / "s", ids, mask, states)
    index = json.loads((tmp_path / "s" / "train" / "index.json").read_text())
    assert all(len(s["sample_xxh3_64"]) == s["num_samples"] for s in index["shards"])
    hs = open_hidden_states(tmp_path / "s")
    assert hs.checks_samples
    first = [hs[i] for i in range(len(hs))]  # every shard opened and mapped, every sample read once
    k, i = 1, 5  # sample 5 is the second of shard 1 (4 samples a shard)
    spec = ShardSpec("train", k, 3, 4, ids[4:8], mask[4:8])
    _, off = shard_header(spec, LAYOUT)
    a = int(spec.offsets[1])
    at = {"aux_hidden_states": off["aux_hidden_states"] + a * 3 * H * 4 + 5,
          "last_hidden_state": off["last_hidden_state"] + a * H * 4 + 2, "input_ids": off["input_ids"] + 4 * a,
          "loss_mask": off["loss_mask"] + a, "offsets": off["offsets"] + 8 * 2}[tensor]
    shard = tmp_path / "s" / "train" / shard_name(k, 3)
    _flip(shard, at)
    if tensor == "offsets":  # read when a shard is opened: a reader opening it anew
        hs = open_hidden_states(tmp_path / "s")
    with pytest.raises(StoreError, match=f"shard {shard}: sample {i} .*not what extract wrote.*stage=extract"):
        hs[i]
    if tensor == "offsets":  # offsets[2] ends sample 5 and starts sample 6
        with pytest.raises(StoreError, match=f"sample {i + 1} "):
            hs[i + 1]
    for j in (0, 4, 7, 10):
        assert torch.equal(hs[j]["last_hidden_state"], first[j]["last_hidden_state"])


def test_a_store_without_sample_checksums_is_read_unchecked(tmp_path):
    """A store written before per-sample checksums: read as before, ``checks_samples`` false."""
    ids, mask, states = _samples()
    _write_store(tmp_path / "s", ids, mask, states)
    path = tmp_path / "s" / "train" / "index.json"
    index = json.loads(path.read_text())
    for s in index["shards"]:
        del s["sample_xxh3_64"]
    path.write_text(json.dumps(index))
    hs = open_hidden_states(tmp_path / "s")
    assert not hs.checks_samples
    assert all(hs[i]["input_ids"].tolist() == ids[i] for i in range(len(hs)))


def test_finalize_refuses_missing_shards_and_is_deterministic(tmp_path):
    ids, mask, states = _samples()
    _write_store(tmp_path / "s", ids, mask, states)
    before = _files(tmp_path / "s")
    finalize_store(tmp_path / "s", LAYOUT, {"train": [len(x) for x in ids]}, 4)
    assert _files(tmp_path / "s") == before
    (tmp_path / "s" / "train" / "shard-00001-of-00003.safetensors").unlink()
    with pytest.raises(StoreError, match="missing"):
        finalize_store(tmp_path / "s", LAYOUT, {"train": [len(x) for x in ids]}, 4)


@pytest.mark.parametrize("L", range(1, 40))
def test_default_layer_ids_are_distinct_and_in_range(L):
    ids = default_layer_ids(L)
    assert len(ids) == min(3, L) and len(set(ids)) == len(ids) and all(0 <= i < L for i in ids)
    assert list(ids) == sorted(ids)
    if L >= 7:
        assert ids == (2, L // 2, L - 3)


def test_layer_id_validation():
    assert default_layer_ids(4) == (1, 2, 3)
    assert resolve_layer_ids([], 30) == (2, 15, 27)
    assert resolve_layer_ids([10, 2, 5], 30) == (2, 5, 10)
    with pytest.raises(LayerIdError, match="last_hidden_state"):
        resolve_layer_ids([2, 30], 30)
    with pytest.raises(LayerIdError, match=r"\[-1\] out of range"):
        resolve_layer_ids([-1, 3], 30)
    assert resolve_store_dtype("auto", "float32", 4096) == "float32"
    assert resolve_store_dtype("auto", "bfloat16", 576) == "bfloat16"
    assert resolve_store_dtype("auto", "bfloat16", 2047) == "bfloat16"
    assert resolve_store_dtype("auto", "bfloat16", 2048) == "fp8"
    assert resolve_store_dtype("auto", "float16", 7168) == "fp8"
    assert resolve_store_dtype("float16", "float32", 64) == "float16"
    assert resolve_store_dtype("bfloat16", "bfloat16", 7168) == "bfloat16"


def test_store_shards_take_the_umask(tmp_path):
    """Shards are created with the umask's mode (0664 under umask 0002), like every file eagle3
    writes, so a group sharing a store can replace or remove them."""
    import os

    from conftest import build_tiny_llama

    from eagle3.config import ExtractConfig
    from eagle3.extract import EngineSpec, Samples, extract_store

    target = build_tiny_llama(tmp_path / "t")
    layout = StoreLayout(layer_ids=(1, 2), last_layer_id=4, hidden_size=64, dtype="float32")
    old = os.umask(0o002)
    try:
        splits = {"train": Samples([[5, 6, 7, 8], [9, 10]])}
        engine = EngineSpec.for_splits(target, layout, "float32",
                                       ExtractConfig(backend="hf", device="cpu", samples_per_shard=1), splits)
        res = extract_store(tmp_path / "store", splits, engine, progress=False)
    finally:
        os.umask(old)
    assert res.complete
    shards = sorted((tmp_path / "store" / "train").glob("shard-*.safetensors"))
    assert len(shards) == 2 and all(p.stat().st_mode & 0o777 == 0o664 for p in shards)
