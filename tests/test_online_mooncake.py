# ruff: noqa: F811
"""train.online.transport=mooncake (eagle3/online/mooncake_exchange.py): producers and the trainer in their
own processes exchange samples, reading order, positions and heartbeats through a real Mooncake master
on loopback TCP, with no directory between them. The guarantees are the directory protocol's
(tests/test_online.py): the losses and weights of offline training on the same states, a bounded
window (here: in the store's memory), producers and trainers killed with -9 and restarted, a silent
producer or master ending the trainer with an error naming it, a trainer of two processes fed by two
producers; and nothing that arrives is trusted unchecked (digests, a shared secret, another run's
messages refused)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("mooncake.store")

from test_online import (  # noqa: E402,F401  (fixtures: target_dir, splits, layout, offline)
    ECFG,
    TCFG,
    _env,
    _wait,
    assert_same_training,
    identity,
    layout,
    make_inputs,
    make_layout,
    make_splits,
    offline,
    splits,
    target_dir,
)

REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent

PRODUCER = """
import json, logging, os, sys
sys.path.insert(0, {tests!r})
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
from pathlib import Path
from eagle3.config import ExtractConfig, MooncakeConfig
from eagle3.extract.backend import EngineSpec, make_extractor
from eagle3.online import produce
from eagle3.online.mooncake_exchange import MooncakeProducerLink, secret_from_env
from test_online import identity, make_layout, make_splits
master, ns, staging, backend, target = sys.argv[1:6]
layer_ids, dtype = json.loads(sys.argv[6]), sys.argv[7]
layout = make_layout(layer_ids)
if dtype != "float32":
    import dataclasses
    layout = dataclasses.replace(layout, dtype=dtype)
extract_cfg = ExtractConfig(backend=backend, device="cpu", batch_size=1, layer_ids=layer_ids)
ext = make_extractor(EngineSpec(target, layout, "float32", extract_cfg, 64), staging)
part, parts = map(int, os.environ.get("PRODUCER_PART", "0/1").split("/"))
link = MooncakeProducerLink(master, ns, Path(staging), MooncakeConfig(), layout, timeout_s=60, poll_s=0.02,
                            secret=secret_from_env())
print("producer ready", flush=True)
stats = produce(link, make_splits(), layout, ext, identity(layout, backend), poll_s=0.02, progress=False, part=part,
                parts=parts, idle_timeout_s=float(os.environ.get("PRODUCER_IDLE", "120")))
print("producer stats", json.dumps(dict(stats, sent_bytes=link.sent_bytes)), flush=True)
ext.close()
"""

TRAINER = """
import json, logging, os, sys
sys.path.insert(0, {tests!r})
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
from pathlib import Path
from eagle3.config import MooncakeConfig, OnlineConfig, TrainConfig
from eagle3.online import ExternalSource, OnlineHiddenStates
from eagle3.online.mooncake_exchange import MooncakeTrainerLink, secret_from_env
from eagle3.train.loop import train
from test_online import TCFG, identity, make_inputs, make_layout, make_splits
master, ns, local, run, target, backend = sys.argv[1:7]
ocfg = OnlineConfig(producer="external", transport="mooncake", poll_s=0.02, **json.loads(sys.argv[7]))
layout, splits = make_layout(), make_splits()
W, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
ident = identity(layout, backend)
link = MooncakeTrainerLink(master, ns, Path(local) / f"rank-{{rank}}", ocfg.mooncake, layout, ident,
                           window_bytes=ocfg.window_bytes, timeout_s=ocfg.timeout_s, rank=rank, poll_s=ocfg.poll_s,
                           secret=secret_from_env())
src = ExternalSource(link, layout, ocfg, ident, rank=rank, world_size=W)
stores = [OnlineHiddenStates(s, splits[s], layout, src) for s in ("train", "eval")]
tcfg = dict(TCFG, batch_size=TCFG["batch_size"] // W)
train(TrainConfig(**tcfg), make_inputs(target, *stores), Path(run), progress=False)
stores[0].close(finished=True)
print("trainer received", link.received_bytes, flush=True)
"""


@pytest.fixture()
def master(tmp_path):
    from eagle3.online.mooncake import MasterProcess

    with MasterProcess(tmp_path / "master.log") as m:  # Mooncake's default --client_ttl (10 s)
        yield m


def start_producer(tmp_path, master, ns: str, target_dir, part: str = "0/1", layer_ids=(1, 2, 3), dtype="float32",
                   env=None) -> subprocess.Popen:
    script = tmp_path / "mc_producer.py"
    script.write_text(PRODUCER.format(tests=str(TESTS)))
    staging = tmp_path / f"staging-{part.replace('/', '-of-')}"
    return subprocess.Popen([sys.executable, str(script), master.address, ns, str(staging), "hf", str(target_dir),
                             json.dumps(list(layer_ids)), dtype],
                            env=dict(_env(), PRODUCER_PART=part, **(env or {})), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def start_trainer(tmp_path, master, ns: str, run: Path, target_dir, env=None, **ocfg) -> subprocess.Popen:
    script = tmp_path / "mc_trainer.py"
    script.write_text(TRAINER.format(tests=str(TESTS)))
    return subprocess.Popen([sys.executable, str(script), master.address, ns, str(tmp_path / "local"), str(run),
                             str(target_dir), "hf", json.dumps(ocfg)], env=dict(_env(), **(env or {})),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


class StoreWatch:
    """The largest number of bytes of this run's training samples seen in the Mooncake store at once, from
    a client of its own that reads rank 0's plan and sizes every key of it every few ms."""

    def __init__(self, master, ns: str, n: int):
        from eagle3.online.mooncake import MooncakeClient
        from eagle3.online.mooncake_exchange import Sealer, sample_key

        self.peak, self.stop = 0, threading.Event()
        self.client = MooncakeClient.connect(master.address, segment_bytes=0)
        sealer = Sealer(None)

        def loop():
            store = self.client._store
            while not self.stop.is_set():
                raw = self.client.get(f"{ns}/rank-0/plan")
                if raw is not None:
                    plan = sealer.open_json(f"{ns}/rank-0/plan", raw)
                    sizes = [store.get_size(sample_key(ns, 0, plan["plan_id"], "train", i)) for i in range(n)]
                    self.peak = max(self.peak, sum(s for s in sizes if s > 0))
                time.sleep(0.005)

        self.thread = threading.Thread(target=loop, daemon=True)
        self.thread.start()

    def close(self) -> int:
        self.stop.set()
        self.thread.join()
        self.client.close()
        return self.peak


def _wait_with(proc, others) -> str:
    """_wait(proc); when it failed, the other processes are stopped and their output added to the error."""
    try:
        return _wait(proc)
    except (AssertionError, subprocess.TimeoutExpired) as e:
        outs = []
        for o in others:
            o.kill()
            outs.append(o.communicate()[0][-3000:])
        raise AssertionError(f"{e}\n--- the other processes:\n" + "\n---\n".join(outs)) from None


def _wait_for_checkpoint(run: Path, step: int, proc, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and not (run / "checkpoints" / f"step-{step:08d}" / "COMPLETE").exists():
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.02)
    assert proc.poll() is None, "the run finished before the fault could be injected"


def test_two_producers_one_killed_and_restarted_train_the_offline_model_in_a_bounded_window(
        offline, target_dir, splits, layout, master, tmp_path):
    """Two producer processes (parts 0 and 1 of 2) and the trainer through a real master: one producer
    killed with -9 mid-run and started again; the losses and weights are offline's, the training samples
    in the store never exceed the window, and with the cache the trainer keeps the first samples on its
    own disk (a store once every one is there: here a part)."""
    from eagle3.online import cached_count, shard_bytes

    run, ns = tmp_path / "run", "t-kill-producer"
    N = len(splits["train"])
    biggest = max(shard_bytes("train", i, N, int(n), layout) for i, n in enumerate(splits["train"].lengths))
    window, budget = 4 * biggest, 150_000
    watch = StoreWatch(master, ns, N)
    other = start_producer(tmp_path, master, ns, target_dir, part="0/2")
    producer = start_producer(tmp_path, master, ns, target_dir, part="1/2")
    trainer = start_trainer(tmp_path, master, ns, run, target_dir, window_bytes=window, cache_bytes=budget,
                            timeout_s=120)
    _wait_for_checkpoint(run, 4, trainer)
    producer.kill()
    producer.wait()
    producer = start_producer(tmp_path, master, ns, target_dir, part="1/2")
    out = _wait_with(trainer, [producer, other])
    stats = [json.loads(o.split("producer stats ")[1]) for o in (_wait(producer), _wait(other))]
    peak = watch.close()
    assert all(s["written"] > 0 for s in stats), stats  # both parts sent (the restarted one too)
    assert_same_training(offline, run)
    assert 0 < peak <= window, (peak, window)  # the store holds messages: their shard + at most MESSAGE_EXTRA
    kept = cached_count(splits["train"].lengths, layout, budget)
    local = tmp_path / "local" / "rank-0"
    assert 0 < kept < N
    assert sorted(int(p.name.split("-")[1]) for p in (local / "train").glob("shard-*.safetensors")) == list(range(kept))
    assert not (local / "eval").exists(), "the held-out samples are removed at the end"
    assert int(out.split("trainer received ")[1].split()[0]) > 0


def test_a_trainer_killed_with_minus_9_resumes_with_the_same_losses(offline, target_dir, master, tmp_path):
    """The trainer killed with -9 after a checkpoint takes its segment (the samples in flight, its plan)
    with it; started again, it resumes from its checkpoint with a new plan, the running producer follows,
    and the losses and weights are offline's."""
    run, ns = tmp_path / "run", "t-kill-trainer"
    producer = start_producer(tmp_path, master, ns, target_dir)
    trainer = start_trainer(tmp_path, master, ns, run, target_dir, window_bytes=1 << 20, timeout_s=120)
    _wait_for_checkpoint(run, 4, trainer)
    trainer.kill()
    trainer.wait()
    trainer = start_trainer(tmp_path, master, ns, run, target_dir, window_bytes=1 << 20, timeout_s=120)
    _wait_with(trainer, [producer])
    stats = json.loads(_wait(producer).split("producer stats ")[1])
    assert stats["plans"] == 2, stats
    assert_same_training(offline, run)


def test_a_trainer_of_two_processes_fed_by_two_producers(offline, target_dir, master, tmp_path):
    """A trainer of two processes (torchrun, gloo), each contributing its own segment with its own plan, fed
    by two producers (parts of 2): the model of one process on the same global batch."""
    run, ns = tmp_path / "run", "t-two-ranks"
    producers = [start_producer(tmp_path, master, ns, target_dir, part=p) for p in ("0/2", "1/2")]
    script = tmp_path / "mc_trainer.py"
    script.write_text(TRAINER.format(tests=str(TESTS)))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           "29547", str(script), master.address, ns, str(tmp_path / "local"), str(run),
                           str(target_dir), "hf", json.dumps(dict(window_bytes=1 << 20, timeout_s=120))],
                          env=dict(_env(), ACCELERATE_USE_CPU="1"), timeout=600, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    stats = [json.loads(_wait(p).split("producer stats ")[1]) for p in producers]
    assert all(s["plans"] == 2 and s["written"] > 0 for s in stats), stats  # each served both ranks
    assert_same_training(offline, run, rtol=1e-5)


# -- in one process: what the trainer refuses, and how it stops ------------------------------------------------

@pytest.fixture()
def links(master, tmp_path, layout):
    """make(ns=..., ...) -> (trainer link, producer link) on the test's master; all closed at the end."""
    from eagle3.config import MooncakeConfig
    from eagle3.online.mooncake_exchange import MooncakeProducerLink, MooncakeTrainerLink

    made, sources = [], []
    make_links.sources = sources

    def make(ns="t-check", trainer_secret=None, producer_secret=None, timeout_s=20.0, lay=None, at=None):
        lay = lay or layout
        m = at or master
        t = MooncakeTrainerLink(m.address, ns, tmp_path / ns / "local", MooncakeConfig(), lay, identity(lay, "hf"),
                                window_bytes=1 << 20, timeout_s=timeout_s, poll_s=0.02, secret=trainer_secret)
        p = MooncakeProducerLink(m.address, ns, tmp_path / ns / "staging", MooncakeConfig(), lay,
                                 timeout_s=timeout_s, poll_s=0.02, secret=producer_secret)
        p.identity = identity(lay, "hf")
        made.extend([t, p])
        return t, p

    yield make
    for src, train in sources:
        src.close(train, finished=False)
    for link in made:
        link.close()


class make_links:  # noqa: N801  (where _source registers what the links fixture closes)
    sources: list = []


def _source(tlink, layout, splits, timeout_s=20.0):
    from eagle3.config import OnlineConfig
    from eagle3.online import ExternalSource, OnlineHiddenStates

    ocfg = OnlineConfig(producer="external", transport="mooncake", poll_s=0.02, timeout_s=timeout_s,
                        window_bytes=1 << 20)
    src = ExternalSource(tlink, layout, ocfg, identity(layout, "hf"))
    train = OnlineHiddenStates("train", splits["train"], layout, src)
    ev = OnlineHiddenStates("eval", splits["eval"], layout, src)
    train.expect([[[i]] for i in range(len(train))])
    make_links.sources.append((src, train))
    return src, train, ev


def _read(src, train, i: int):
    """Sample i read at position i, as the loop would (reads ahead given up after it)."""
    src.pos = i
    try:
        return src.item(train, i)
    finally:
        src._closed.set()
        src._drop_ahead()
        src._closed.clear()


_EXT: dict = {}


def _send(plink, tlink, i: int, splits, layout, target_dir, split="train") -> None:
    """Sample i computed by the real hf backend into the producer's staging directory and sent for the
    trainer's current plan, as the producer loop does."""
    from eagle3.extract.backend import Progress
    from eagle3.extract.hf_backend import HFExtractor
    from eagle3.store import one_sample_shard

    key = (str(target_dir), layout.dtype)
    if key not in _EXT:
        _EXT[key] = HFExtractor(str(target_dir), layout, "float32", ECFG)
    n = len(splits[split])
    ids, mask = splits[split].get(i, i + 1)
    spec = one_sample_shard(split, i, n, ids[0], mask[0])
    _EXT[key].run([spec], plink.staging(0), Progress(spec.num_tokens, "", False))
    plink.publish(0, tlink.plan, [spec])
    plink._queue.join()  # sent (the sender thread puts it)


def test_every_received_sample_is_checked_and_another_runs_refused(target_dir, splits, layout, links, tmp_path):
    """A sample that arrives is the offline store's bits and is removed from the store once read. Refused,
    each by an error naming the key: one whose bytes changed on the way; a good message moved to another
    sample's key; one sealed for this key but sent for another namespace, plan, producer identity or
    layout; another prepared sample's shard under this sample's header."""
    from eagle3.extract import EngineSpec, extract_store
    from eagle3.online import OnlineError
    from eagle3.online.mooncake_exchange import pack_sample, sample_key, unpack_sample
    from eagle3.store import open_hidden_states

    extract_store(tmp_path / "ref", splits, EngineSpec.for_splits(target_dir, layout, "float32", ECFG, splits), progress=False)
    ref = open_hidden_states(tmp_path / "ref", "train", fp8="raw")
    tlink, plink = links()
    src, train, ev = _source(tlink, layout, splits)
    plan = tlink.plan["plan_id"]
    key = lambda i: sample_key(tlink.ns, 0, plan, "train", i)  # noqa: E731

    _send(plink, tlink, 0, splits, layout, target_dir)
    item = _read(src, train, 0)
    assert all(torch.equal(item[k], ref[0][k]) for k in ("input_ids", "aux_hidden_states", "last_hidden_state"))
    assert tlink.client.get(key(0)) is None, "removed once read"

    _send(plink, tlink, 1, splits, layout, target_dir)
    good = tlink.client.get(key(1))
    bad = good.copy()
    bad[len(bad) // 2] ^= 1  # one bit of the states flipped
    tlink.client.put(key(1), bad)
    with pytest.raises(OnlineError, match=f"{key(1)}.*does not match its digest"):
        _read(src, train, 1)
    tlink.client.put(key(2), good)  # sealed for sample 1, put as sample 2
    with pytest.raises(OnlineError, match=f"{key(2)}.*does not match its digest"):
        _read(src, train, 2)
    tlink.client.put(key(1), good)
    assert torch.equal(_read(src, train, 1)["last_hidden_state"], ref[1]["last_hidden_state"])

    # sealed for this key, but the header says another run, plan, producer or layout
    _send(plink, tlink, 2, splits, layout, target_dir)
    header, payload = unpack_sample(key(2), tlink.client.get(key(2)), tlink.sealer)
    staged = tmp_path / "forged.safetensors"
    staged.write_bytes(payload.tobytes())
    from eagle3.online.mooncake_exchange import digest_of

    other_identity = digest_of(dict(identity(layout, "hf"), backend="vllm"))
    other_layout = digest_of(make_layout((0, 1, 2)).to_json())
    for change, what in ((dict(ns="another-run"), "ns"), (dict(plan_id="0" * 32), "plan_id"),
                         (dict(identity_digest=other_identity), "identity_digest"),
                         (dict(layout_digest=other_layout), "layout_digest")):
        tlink.client.put(key(2), pack_sample(key(2), dict(header, **change), staged, plink.sealer))
        with pytest.raises(OnlineError, match=f"{key(2)}.*not what this trainer reads there.*'{what}'"):
            _read(src, train, 2)
    # sample 3's shard under sample 2's header, sealed for sample 2's key: not the shard sample 2 has
    _send(plink, tlink, 3, splits, layout, target_dir)
    _, payload3 = unpack_sample(key(3), tlink.client.get(key(3)), tlink.sealer)
    staged.write_bytes(payload3.tobytes())
    tlink.client.put(key(2), pack_sample(key(2), header, staged, plink.sealer))
    with pytest.raises(OnlineError, match="is not the one this trainer expects for train sample 2"):
        _read(src, train, 2)


@pytest.mark.parametrize("case", ["trainer-only", "producer-only", "other-secret", "same-secret"])
def test_a_shared_secret_authenticates_producers(target_dir, splits, layout, links, case):
    """With EAGLE3_ONLINE_SECRET every object is sealed with a keyed BLAKE3 MAC: a producer without the
    secret, or with another, is refused naming the setting (its samples, and it refuses the trainer's
    plan); with the same secret the sample is accepted."""
    from eagle3.online import OnlineError

    trainer_secret, producer_secret = {"trainer-only": (b"s" * 32, None), "producer-only": (None, b"s" * 32),
                                       "other-secret": (b"s" * 32, b"t" * 32),
                                       "same-secret": (b"s" * 32, b"s" * 32)}[case]
    tlink, plink = links(ns=f"t-secret-{case}", trainer_secret=trainer_secret, producer_secret=producer_secret)
    src, train, ev = _source(tlink, layout, splits)
    _send(plink, tlink, 0, splits, layout, target_dir)
    if case == "same-secret":
        assert _read(src, train, 0)["input_ids"].tolist() == splits["train"].get(0, 1)[0][0]
        assert plink.read(0, "plan")["plan_id"] == tlink.plan["plan_id"]
        return
    match = "EAGLE3_ONLINE_SECRET" if case != "other-secret" else "valid tag of this run's secret"
    with pytest.raises(OnlineError, match=match):
        _read(src, train, 0)
    with pytest.raises(OnlineError, match=match):
        plink.read(0, "plan")


def test_a_producer_of_another_identity_is_named(splits, layout, links):
    """A producer computing other states (other layer ids) announces itself; the trainer waiting for a
    sample refuses it naming the difference, before any of its samples is read."""
    from eagle3.online import OnlineError

    tlink, plink = links(ns="t-identity")
    src, train, ev = _source(tlink, layout, splits)
    other = identity(make_layout((0, 1, 2)), "hf")
    beat = plink.heartbeat(0, 1, {"identity": other, "host": "gpu-node-7", "pid": 4242, "part": 0, "parts": 1}, 0.2)
    try:
        with pytest.raises(OnlineError, match=r"gpu-node-7.*does not produce what this trainer needs.*layer_ids"):
            _read(src, train, 0)
    finally:
        beat.close()


def test_a_silent_producer_and_a_master_that_stops_end_the_trainer_naming_them(splits, layout, links, tmp_path):
    """No producer: the trainer stops after train.online.timeout_s naming what it waited for. The master
    stopped while the trainer waits: it stops within timeout_s naming the master's address and setting,
    as a stall (the loop saves a checkpoint). No master at an address: at once, the same."""
    from eagle3.config import MooncakeConfig
    from eagle3.online.external import ProducerTimeout
    from eagle3.online.mooncake import MasterProcess, MooncakeError
    from eagle3.online.mooncake_exchange import MasterUnreachable, MooncakeTrainerLink
    from eagle3.train.source import SourceStalled

    tlink, _ = links(ns="t-silent", timeout_s=2.0)
    src, train, ev = _source(tlink, layout, splits, timeout_s=2.0)
    t0 = time.monotonic()
    with pytest.raises(ProducerTimeout, match="no producer has written .*producer-<p>-of-<N>"):
        _read(src, train, 0)
    assert 2.0 <= time.monotonic() - t0 < 20

    m2 = MasterProcess(tmp_path / "m2.log")
    tlink, plink = links(ns="t-master", timeout_s=3.0, at=m2)
    src, train, ev = _source(tlink, layout, splits, timeout_s=3.0)
    m2.stop()
    t0 = time.monotonic()
    with pytest.raises(MasterUnreachable, match=f"{m2.address}.*train.online.mooncake.master") as e:
        _read(src, train, 0)
    assert isinstance(e.value, SourceStalled)
    assert time.monotonic() - t0 < 30

    t0 = time.monotonic()
    with pytest.raises(MooncakeError, match=f"no Mooncake master answers at {m2.address}.*train.online.mooncake.master"):
        MooncakeTrainerLink(m2.address, "x", tmp_path / "c", MooncakeConfig(connect_timeout_s=2), layout, {},
                            window_bytes=1 << 20, timeout_s=600)
    assert time.monotonic() - t0 < 10


def test_fp8_travels_as_the_fp8_store_holds_it(target_dir, splits, links, tmp_path):
    """With store_dtype fp8 the message carries the store's fp8 layout (e4m3 values, one float32 scale a token
    and layer): the item is the fp8 store's bit for bit, and its bytes on the wire are one a value plus the
    scales and headers."""
    import dataclasses

    from eagle3.extract import EngineSpec, extract_store
    from eagle3.store import open_hidden_states

    fp8 = dataclasses.replace(make_layout(), dtype="fp8")
    extract_store(tmp_path / "ref", splits, EngineSpec.for_splits(target_dir, fp8, "float32", ECFG, splits), progress=False)
    ref = open_hidden_states(tmp_path / "ref", "train", fp8="raw")
    tlink, plink = links(ns="t-fp8", lay=fp8)
    src, train, ev = _source(tlink, fp8, splits)
    _send(plink, tlink, 0, splits, fp8, target_dir)
    item = _read(src, train, 0)
    bits = lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # noqa: E731
    for k in ("input_ids", "aux_hidden_states", "last_hidden_state", "aux_scales", "last_scales"):
        assert item[k].dtype == ref[0][k].dtype and torch.equal(bits(item[k]), bits(ref[0][k])), k
    T, H, n = len(item["input_ids"]), fp8.hidden_size, fp8.n_aux + 1
    assert T * n * (H + 4) < tlink.received_bytes < T * n * (H + 4) + T * 13 + 16384


def test_cli_one_host_needs_no_master_given(target_dir, tmp_path):
    """`python -m eagle3 stage=produce` and `stage=train` with train.online.transport=mooncake and no master
    address, started in that order: the trainer starts a master on 127.0.0.1 and records it in the run's
    online directory, where the producer (waiting for it) finds it; the run completes, the producer exits,
    and the master is stopped with the trainer."""
    from eagle3.manifest import Manifest

    ws = tmp_path / "ws"
    common = [f"workspace={ws}", "experiment=t", f"target.path={target_dir}", "data.max_samples=24",
              "prepare.max_length=128", "prepare.draft_vocab_size=200", "extract.layer_ids=[1,2,3]",
              "extract.device=cpu", "extract.batch_size=1", "extract.backend=hf", "logger.mode=disabled",
              "progress=false", "cpu_threads=1", "train.ttt_steps=2", "train.max_steps=6", "train.batch_size=2",
              "train.max_seq_len=128", "train.packing=false", "train.eval_every=4", "train.hidden_states=online",
              "train.online.producer=external", "train.online.transport=mooncake",
              "train.online.window_bytes=1000000", "train.online.poll_s=0.02", "train.online.timeout_s=300"]

    def eagle3(stage):
        env = _env()
        env.pop("EAGLE3_MOONCAKE_MASTER", None)
        return subprocess.Popen([sys.executable, "-m", "eagle3", f"stage={stage}", *common], env=env, cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    from eagle3.__main__ import compose_config
    from eagle3.runner import run

    run(compose_config(["stage=prepare", *common]))
    producer = eagle3("produce")
    time.sleep(1.0)
    trainer = eagle3("train")
    out_t, out_p = _wait(trainer), _wait(producer)
    rec = Manifest(ws / "t").current("train")
    assert rec.status == "complete" and rec.facts.producer["placement"] == "external", out_t[-2000:]
    online = rec.out_dir / "online"
    master = json.loads((online / "mooncake-master.json").read_text())
    assert master["address"].startswith("127.0.0.1:")
    assert "Mooncake exchange (namespace eagle3-" in out_p and "Mooncake exchange (namespace eagle3-" in out_t
    assert "produce: the trainer finished" in out_p
    with pytest.raises(ProcessLookupError):  # stopped with the trainer
        os.kill(int(master["pid"]), 0)
    assert not list(online.rglob("shard-*")), "no cache: nothing left on either side's disk"
