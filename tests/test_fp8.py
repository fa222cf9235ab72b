"""The fp8 store (extract.store_dtype=fp8): quantisation (error bounds, zero and non-finite rows,
the same bits whatever the batching), the shard format and writer (resume, byte identity), the
reader (dequantised by default, raw values + scales, refusals that name the shard), the train
loop on an fp8 store against the loop on the dequantised store, and the extract stage end to end."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from conftest import build_tiny_llama, chat_records, write_jsonl

from eagle3.extract.writer import CapturedBatch, ShardWriter
from eagle3.fp8 import FP8_MAX, bad_scales, dequantize, quantize
from eagle3.hashing import sha256_tree_file
from eagle3.store import (
    FORMAT,
    FORMAT_FP8,
    ShardSpec,
    StoreError,
    StoreLayout,
    completed_shard,
    finalize_store,
    open_hidden_states,
    shard_header,
    shard_ranges,
)


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


# -- quantisation -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_error_bounds(dtype):
    g = torch.Generator().manual_seed(0)
    # rows of very different magnitudes, heavy tails (a few large outliers, as real states have)
    x = torch.randn(64, 5, 96, generator=g) * torch.logspace(-3, 2, 64)[:, None, None]  # fp16 holds x 40 of 1e2
    x[:, :, :3] *= 40
    x = x.to(dtype)
    v, s = quantize(x)
    assert v.dtype == torch.float8_e4m3fn and v.shape == x.shape
    assert s.dtype == torch.float32 and s.shape == x.shape[:-1] and bad_scales(s) == 0
    ref = x.float()
    assert torch.equal(s, ref.abs().amax(-1) * torch.tensor(1 / 448, dtype=torch.float32))
    assert float(v.float().abs().amax()) == FP8_MAX  # the largest element of each row lands on e4m3's max
    deq = dequantize(v, s)
    err = (deq - ref).abs()
    normal = ref.abs() >= s[..., None] * 2.0 ** -6  # e4m3 normal range
    # round to nearest: half an ulp, 2^-4 of the value's binade (relative to |x|, at most 2^-4)
    assert bool((err[normal] <= 2.0 ** -4 * ref.abs()[normal] * (1 + 1e-6)).all())
    assert bool((err[~normal] <= (2.0 ** -10 * s[..., None].expand_as(err))[~normal] * (1 + 1e-6)).all())
    row = (deq - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert float(row.max()) < 0.05 and float(row.mean()) < 0.035
    assert dequantize(v, s, torch.bfloat16).dtype == torch.bfloat16


def test_zero_and_non_finite_rows():
    x = torch.randn(4, 8)
    x[1] = 0
    x[2, 3] = float("inf")
    x[3, 0] = float("nan")
    v, s = quantize(x)
    assert s[1] == 1 and not bool(v[1].float().any()) and bool((dequantize(v, s)[1] == 0).all())
    assert s[0] > 0 and torch.isfinite(s[0])
    assert torch.isinf(s[2]) and torch.isnan(s[3])
    assert bad_scales(s) == 2 and bad_scales(torch.tensor([0.0, -1.0, 1.0])) == 2


def test_same_bits_whatever_the_batching():
    """The extraction quantises a step's rows together, in batches that depend on the backend: a
    row's bits must depend on the row alone (and be the same run to run)."""
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(300, 3, 64, generator=g) * 7).to(torch.bfloat16)
    v, s = quantize(x)
    v2, s2 = quantize(x)
    assert _bits(v) == _bits(v2) and _bits(s) == _bits(s2)
    parts = [quantize(x[a:a + 37]) for a in range(0, 300, 37)]
    assert _bits(v) == _bits(torch.cat([p[0] for p in parts])) and _bits(s) == _bits(torch.cat([p[1] for p in parts]))
    # a non-contiguous view of the same rows (the writer stacks layers; vLLM hands out slices)
    wide = torch.zeros(300, 3, 128, dtype=torch.bfloat16)
    wide[..., ::2] = x
    vn, sn = quantize(wide[..., ::2])
    assert _bits(v) == _bits(vn) and _bits(s) == _bits(sn)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        v1, s1 = quantize(x)
    finally:
        torch.set_num_threads(threads)
    assert _bits(v) == _bits(v1) and _bits(s) == _bits(s1)
    # from float32 states: the same as from their bf16 copy only where the bf16 copy is exact
    v3, s3 = quantize(x.float())
    assert _bits(v) == _bits(v3) and _bits(s) == _bits(s3)


# -- the store ----------------------------------------------------------------------------------------

def _samples(n, H, n_layers, seed=0, max_len=30):
    rng = random.Random(seed)
    lengths = [rng.randint(1, max_len) for _ in range(n)]
    lengths[2] = 0
    ids = [[rng.randrange(1000) for _ in range(t)] for t in lengths]
    mask = [[rng.randrange(2) for _ in range(t)] for t in lengths]
    states = [torch.randn(t, n_layers, H, generator=torch.Generator().manual_seed(50 + i)) * (1 + i)
              for i, t in enumerate(lengths)]
    for s in states:
        if len(s) > 1:
            s[1, 0] = 0  # a zero row of the first layer
    return ids, mask, states


def _write(store_dir, layout, ids, mask, states, sps=3, chunk_seed=0, stop_after=None, quantise_here=False):
    """Chunks of random sizes, samples interleaved (as prefill steps come). ``stop_after``: abort
    after that many shards (a killed run). ``quantise_here``: batches arrive quantised already
    (HostStager.capture's path) rather than quantised by the writer thread."""
    rng = random.Random(chunk_seed)
    writer = ShardWriter(store_dir, layout)
    ranges = shard_ranges(len(ids), sps)
    for k, (first, count) in enumerate(ranges):
        spec = ShardSpec("train", k, len(ranges), first, ids[first:first + count], mask[first:first + count])
        if completed_shard(store_dir / "train", spec, layout) is not None:
            continue
        if stop_after is not None and k == stop_after:
            writer.begin(spec)
            s = states[first][:1]
            writer.write(CapturedBatch([(("train", k), 0, 0, 0, 1)], s[:, :-1], s[:, -1]))
            writer.abort()
            return
        writer.begin(spec)
        queues = []  # per sample: its chunks in order (as prefill sends them); samples interleave
        for j in range(count):
            n, pos, q = len(ids[first + j]), 0, []
            while pos < n:
                m = min(rng.randint(1, 6), n - pos)
                q.append((j, pos, m))
                pos += m
            if q:
                queues.append(q)
        while queues:
            q = rng.choice(queues)
            j, p, m = q.pop(0)
            if not q:
                queues.remove(q)
            s = states[first + j][p:p + m]
            if quantise_here:
                (va, sa), (vl, sl) = quantize(s[:, :-1]), quantize(s[:, -1])
                writer.write(CapturedBatch([(("train", k), j, p, 0, m)], va, vl, aux_scales=sa, last_scales=sl))
            else:
                writer.write(CapturedBatch([(("train", k), j, p, 0, m)], list(s[:, :-1].unbind(1)), s[:, -1]))
        writer.end(("train", k))
    writer.close()
    finalize_store(store_dir, layout, {"train": [len(x) for x in ids]}, sps)


def _files(d):
    return {p.relative_to(d): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file() and not p.name.startswith(".")}


# H=15 with 2 aux layers: the fp8 bytes of a shard end unaligned, so a pad tensor aligns the scales
@pytest.mark.parametrize("layer_ids,H", [((1, 2, 4), 16), ((1, 3), 15)])
def test_fp8_store_round_trip(tmp_path, layer_ids, H):
    from safetensors.torch import load_file

    layout = StoreLayout(layer_ids=layer_ids, last_layer_id=6, hidden_size=H, dtype="fp8")
    n = len(layer_ids) + 1
    assert layout.bytes_per_token == n * (H + 4) + 5 and layout.format == FORMAT_FP8
    ids, mask, states = _samples(8, H, n)
    _write(tmp_path / "s", layout, ids, mask, states)
    meta = json.loads((tmp_path / "s" / "store.json").read_text())
    assert meta["format"] == FORMAT_FP8 and meta["dtype"] == "fp8" and meta["bytes_per_token"] == layout.bytes_per_token
    raw, deq = open_hidden_states(tmp_path / "s", fp8="raw"), open_hidden_states(tmp_path / "s")
    for i in range(len(ids)):
        r, d = raw[i], deq[i]
        va, sa = quantize(states[i][:, :-1])
        vl, sl = quantize(states[i][:, -1])
        assert r["aux_hidden_states"].dtype == torch.float8_e4m3fn and r["aux_hidden_states"].shape == (len(ids[i]), n - 1, H)
        assert _bits(r["aux_hidden_states"]) == _bits(va) and _bits(r["aux_scales"]) == _bits(sa)
        assert _bits(r["last_hidden_state"]) == _bits(vl) and _bits(r["last_scales"]) == _bits(sl)
        assert d["aux_hidden_states"].dtype == torch.float32 and "aux_scales" not in d
        assert torch.equal(d["aux_hidden_states"], dequantize(va, sa)) and torch.equal(d["last_hidden_state"], dequantize(vl, sl))
        assert r["input_ids"].tolist() == ids[i] and r["loss_mask"].int().tolist() == mask[i]
    shard = tmp_path / "s" / "train" / "shard-00000-of-00003.safetensors"
    t = load_file(str(shard))  # a plain safetensors file
    assert t["aux_hidden_states"].dtype == torch.float8_e4m3fn and t["aux_scales"].dtype == torch.float32
    assert ("scales_pad" in t) == (H % 4 != 0 and n % 4 != 0)
    size_per_token = shard.stat().st_size / sum(len(x) for x in ids[:3])
    assert size_per_token < layout.bytes_per_token + 60  # + the header, amortised over few tokens


def test_fp8_writer_bytes_on_resume_and_whatever_the_order(tmp_path):
    """The same bytes from: chunks in another order, batches quantised before the writer (the GPU
    stager's path), and a run killed after one shard (mid second shard) then resumed."""
    layout = StoreLayout(layer_ids=(1, 3), last_layer_id=6, hidden_size=15, dtype="fp8")
    ids, mask, states = _samples(9, 15, 3)
    _write(tmp_path / "a", layout, ids, mask, states, chunk_seed=1)
    _write(tmp_path / "b", layout, ids, mask, states, chunk_seed=2, quantise_here=True)
    _write(tmp_path / "c", layout, ids, mask, states, stop_after=1)
    assert len(list((tmp_path / "c" / "train").glob("shard-*.safetensors"))) == 1
    assert not list((tmp_path / "c").rglob(".*.tmp*")) and not (tmp_path / "c" / "store.json").exists()
    _write(tmp_path / "c", layout, ids, mask, states, chunk_seed=3)
    a, b, c = _files(tmp_path / "a"), _files(tmp_path / "b"), _files(tmp_path / "c")
    assert a == b == c
    for side in (tmp_path / "c" / "train").glob("shard-*.json"):
        rec = json.loads(side.read_text())
        assert sha256_tree_file(side.parent / rec["file"], rec["tree_chunk"]) == rec["sha256_tree"]


@pytest.fixture
def fp8_store(tmp_path):
    layout = StoreLayout(layer_ids=(1, 2, 4), last_layer_id=6, hidden_size=16, dtype="fp8")
    ids, mask, states = _samples(8, 16, 4)
    _write(tmp_path / "s", layout, ids, mask, states)
    return tmp_path / "s", layout, ids, mask, states


def test_rows_of_an_fp8_store_are_dequantised_as_items_are(fp8_store):
    """HiddenStates.rows (what the agreement and parity checks read) gives the same float32 rows as
    the dequantised item, for both tensors: never the raw float8 values."""
    store, *_ = fp8_store
    hs = open_hidden_states(store)
    for i in (0, 5):
        item = hs[i]
        positions = [0, len(item["input_ids"]) - 1]
        for name in ("aux_hidden_states", "last_hidden_state"):
            rows = hs.rows(i, name, positions)
            assert rows.dtype == torch.float32 and torch.equal(rows, item[name][positions])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0])
def test_reader_refuses_bad_scales_naming_the_shard(fp8_store, bad):
    store, layout, ids, mask, states = fp8_store
    name = "shard-00001-of-00003.safetensors"
    path = store / "train" / name
    spec = ShardSpec("train", 1, 3, 3, ids[3:6], mask[3:6])
    _, off = shard_header(spec, layout)
    data = bytearray(path.read_bytes())
    data[off["last_scales"] + 4 * 2: off["last_scales"] + 4 * 3] = np.float32(bad).tobytes()  # token 2 of the shard
    path.write_bytes(bytes(data))
    hs = open_hidden_states(store, fp8="raw")
    owner = next(j for j in range(3, 6) if sum(len(x) for x in ids[3:j]) <= 2 < sum(len(x) for x in ids[3:j + 1]))
    with pytest.raises(StoreError, match=f"{name}.*last_scales of sample {owner}"):
        hs[owner]
    with pytest.raises(StoreError, match=name):
        open_hidden_states(store)[owner]  # dequantising: the same refusal
    assert hs[0]["aux_hidden_states"].shape[0] == len(ids[0])  # other shards read on


@pytest.mark.parametrize("tensor", ["aux_hidden_states", "aux_scales", "last_scales"])
def test_the_checksum_covers_an_fp8_samples_values_and_scales(fp8_store, tensor):
    """An fp8 sample's checksum covers what the reader takes: the float8 values and both scale
    tensors (a scale changed to another valid one dequantises to other states, unnoticed otherwise)."""
    store, layout, ids, mask, states = fp8_store
    path = store / "train" / "shard-00001-of-00003.safetensors"
    spec = ShardSpec("train", 1, 3, 3, ids[3:6], mask[3:6])
    _, off = shard_header(spec, layout)
    hs = open_hidden_states(store, fp8="raw")
    hs[4]  # the shard opened and mapped before its bytes change
    a = int(spec.offsets[1])  # sample 4's first row
    at = off[tensor] + a * {"aux_hidden_states": 3 * 16, "aux_scales": 3 * 4, "last_scales": 4}[tensor]
    data = bytearray(path.read_bytes())
    if tensor == "aux_hidden_states":
        data[at] ^= 0x01  # one float8 value's lowest bit
    else:  # a finite positive scale, doubled
        data[at:at + 4] = (np.frombuffer(bytes(data[at:at + 4]), np.float32) * 2).tobytes()
    path.write_bytes(bytes(data))
    for reader in (hs, open_hidden_states(store)):  # raw, and dequantised
        with pytest.raises(StoreError, match=f"{path.name}: sample 4 .*not what extract wrote"):
            reader[4]
        assert reader[3]["input_ids"].tolist() == ids[3] and reader[5]["input_ids"].tolist() == ids[5]


def test_reader_refuses_a_shard_without_scales(fp8_store):
    from safetensors import safe_open
    from safetensors.torch import save_file

    store, *_ = fp8_store
    name = "shard-00000-of-00003.safetensors"
    path = store / "train" / name
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys() if not k.endswith("_scales")}
    save_file(tensors, str(path), metadata=meta)
    index = json.loads((store / "train" / "index.json").read_text())
    index["shards"][0]["size"] = path.stat().st_size
    (store / "train" / "index.json").write_text(json.dumps(index))
    with pytest.raises(StoreError, match=f"{name}.*aux_scales"):
        open_hidden_states(store)[0]


def test_other_dtypes_and_readers_never_misread(fp8_store, tmp_path, monkeypatch):
    import eagle3.store as store_mod

    store, layout, ids, mask, states = fp8_store
    # a reader that knows only the bf16/f32 format (eagle3 before fp8) refuses the store
    monkeypatch.setattr(store_mod, "FORMATS", (FORMAT,))
    with pytest.raises(StoreError, match="eagle3.hidden_states/2"):
        open_hidden_states(store)
    monkeypatch.undo()
    # a bf16 shard dropped into the fp8 store is refused, naming it
    bf = StoreLayout(layer_ids=(1, 2, 4), last_layer_id=6, hidden_size=16, dtype="bfloat16")
    _write(tmp_path / "bf", bf, ids, mask, states)
    name = "shard-00001-of-00003.safetensors"
    (store / "train" / name).write_bytes((tmp_path / "bf" / "train" / name).read_bytes())
    index = json.loads((store / "train" / "index.json").read_text())
    index["shards"][1]["size"] = (store / "train" / name).stat().st_size
    (store / "train" / "index.json").write_text(json.dumps(index))
    with pytest.raises(StoreError, match=f"{name}.*bfloat16.*fp8"):
        open_hidden_states(store)[4]
    # resuming an fp8 extraction over a bf16 shard (or the reverse) is refused, not mixed
    spec = ShardSpec("train", 1, 3, 3, ids[3:6], mask[3:6])
    with pytest.raises(StoreError, match="another extraction"):
        completed_shard(store / "train", spec, layout)
    with pytest.raises(StoreError, match="another extraction"):
        completed_shard(store / "train", ShardSpec("train", 0, 3, 0, ids[:3], mask[:3]), bf)
    # a bf16 store read raw (as the train stage reads) is just bf16: no scales
    item = open_hidden_states(tmp_path / "bf", fp8="raw")[0]
    assert item["aux_hidden_states"].dtype == torch.bfloat16 and "aux_scales" not in item
    with pytest.raises(ValueError, match="fp8 must be"):
        open_hidden_states(tmp_path / "bf", fp8="bf16")


def test_collate_and_model_inputs_dequantise_on_the_device(fp8_store):
    """collate keeps float8 + scales (padding scale 1); model_inputs gives what the dequantised
    store gives, in the compute dtype."""
    from eagle3.train.data import collate
    from eagle3.train.target_head import TargetHead, model_inputs

    store, *_ = fp8_store
    raw, deq = open_hidden_states(store, fp8="raw"), open_hidden_states(store)
    rows = [[0, 1], [4]]
    br = collate([[raw[i] for i in r] for r in rows], 64)
    bd = collate([[deq[i] for i in r] for r in rows], 64)
    assert br["aux_hidden_states"].dtype == torch.float8_e4m3fn and br["aux_scales"].shape == (2, bd["input_ids"].shape[1], 3)
    assert bool((br["last_scales"][bd["doc_ids"] < 0] == 1).all())
    g = torch.Generator().manual_seed(0)
    V, H = 1000, 16
    head = TargetHead(torch.randn(V, H, generator=g), torch.ones(H), torch.randn(V, H, generator=g), 1e-6,
                      torch.arange(0, V, 3))
    for dtype in (torch.float32, torch.bfloat16):
        a, b = model_inputs(head, br, dtype), model_inputs(head, bd, dtype)
        assert a["aux"].dtype == dtype and torch.equal(a["aux"], b["aux"])
        assert torch.equal(a["target_probs"], b["target_probs"]) and torch.equal(a["in_vocab"], b["in_vocab"])


# -- extraction and training on a real (tiny) target -------------------------------------------------

@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("target"), initializer_range=0.2)


@pytest.fixture(scope="module")
def stores(tiny_target, tmp_path_factory):
    """The same samples extracted by the hf backend from a float32 target into a float32 and an fp8 store."""
    import datasets

    from eagle3.config import ExtractConfig
    from eagle3.extract import DatasetSamples, EngineSpec, extract_store

    rng = np.random.default_rng(0)
    splits = {}
    for split, n in (("train", 12), ("eval", 3)):
        x = [rng.integers(3, 300, size=int(rng.integers(20, 48))).tolist() for _ in range(n)]
        m = [[0] * 4 + [1] * (len(s) - 4) for s in x]
        splits[split] = DatasetSamples(datasets.Dataset.from_dict({"input_ids": x, "loss_mask": m}))
    out = {}
    for dtype in ("float32", "fp8"):
        d = tmp_path_factory.mktemp(dtype)
        layout = StoreLayout(layer_ids=(1, 2, 3), last_layer_id=4, hidden_size=64, dtype=dtype)
        engine = EngineSpec.for_splits(tiny_target, layout, "float32",
                                       ExtractConfig(backend="hf", device="cpu", samples_per_shard=4), splits)
        res = extract_store(d, splits, engine, progress=False)
        assert res.complete
        out[dtype] = d
    return out


def test_hf_fp8_store_is_the_quantised_float32_store(stores):
    for split in ("train", "eval"):
        f32, raw = open_hidden_states(stores["float32"], split), open_hidden_states(stores["fp8"], split, fp8="raw")
        for i in range(len(f32)):
            a, b = f32[i], raw[i]
            for name, scales in (("aux_hidden_states", "aux_scales"), ("last_hidden_state", "last_scales")):
                v, s = quantize(a[name])
                assert _bits(v) == _bits(b[name]) and _bits(s) == _bits(b[scales]), (split, i, name)


def test_train_loop_on_fp8_store_matches_the_dequantised_store(stores, tiny_target, tmp_path):
    """The train stage's path (store read raw, dequantised inside the step) trains exactly what
    the loop trains on the dequantised states (the reader's default)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_train import make_inputs

    from eagle3.config import TrainConfig
    from eagle3.train.loop import train

    tcfg = TrainConfig(ttt_steps=2, max_steps=6, lr=5e-3, warmup_steps=1, batch_size=2, max_seq_len=128,
                       log_every=1, eval_every=3, save_every=100, mixed_precision="no", num_workers=0)
    losses = {}
    for mode in ("dequantize", "raw"):
        inputs = make_inputs(stores["fp8"], tiny_target)
        inputs.train_store = open_hidden_states(stores["fp8"], "train", fp8=mode)
        inputs.eval_store = open_hidden_states(stores["fp8"], "eval", fp8=mode)
        out = tmp_path / mode
        result = train(tcfg, inputs, out, progress=False)
        recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        losses[mode] = ([r["train/loss"] for r in recs if "train/loss" in r], result.eval.loss)
    (a, ea), (b, eb) = losses["dequantize"], losses["raw"]
    assert len(a) == len(b) == 6
    np.testing.assert_allclose(a, b, rtol=1e-6)
    assert abs(ea - eb) <= 1e-6 * abs(ea)


def test_extract_stage_fp8_end_to_end(tmp_path, compose, tiny_llama_dir, capsys):
    """extract.store_dtype=fp8 through the runner (hf backend, float32 target): facts, the size
    printed at the end and in stage=status, and a train stage that reads it."""
    from eagle3.manifest import Manifest
    from eagle3.report import status_rows
    from eagle3.runner import run

    chats = write_jsonl(tmp_path / "chats.jsonl", chat_records(16, turns=1))
    common = [f"target.path={tiny_llama_dir}", f"data.path={chats}", f"workspace={tmp_path}", "experiment=f",
              "logger=jsonl", "prepare.draft_vocab_size=64", "progress=false", "extract.backend=hf",
              "extract.store_dtype=fp8", "extract.samples_per_shard=4"]
    run(compose("stage=prepare", *common))
    run(compose("stage=extract", *common))
    printed = capsys.readouterr().out
    m = Manifest(tmp_path / "f")
    rec = m.current("extract")
    f = rec.facts
    assert f.layout.dtype == "fp8" and f.layout.format == FORMAT_FP8 and f.target_dtype == "float32"
    assert f.layout.bytes_per_token == 4 * (64 + 4) + 5
    tokens = sum(f.num_tokens.values())
    assert f"fp8 store, {f.layout.bytes_per_token} bytes/token" in printed and f"{tokens} tokens" in printed
    row = next(r for r in status_rows(m) if r["stage"] == "extract")
    assert "bytes_per_token=277" in row["facts"] and f"tokens={tokens}, store=" in row["facts"]
    hs = open_hidden_states(tmp_path / "f")
    assert hs.dtype == "fp8" and hs[0]["aux_hidden_states"].dtype == torch.float32
    run(compose("stage=train", *common, "train.max_steps=2", "train.batch_size=2", "train.max_seq_len=128",
                "train.eval_every=2", "train.ttt_steps=2"))
    t = m.current("train")
    assert t.status == "complete" and np.isfinite(t.facts.eval.loss)
