"""The exchange directory: what trainer and producers share (``train.online.dir``); the directory is
the protocol, no server.

(a trainer of several processes: each rank has the files below in ``rank-<r>/``, its own window)

``plan.json``      the trainer's reading order (sample ids, in reading order), its layout (target
                   hash, layer ids, dtype), the window and the cached samples; rewritten atomically
                   at every (re)start with a new ``plan_id``
``consumed.json``  the trainer's position in the order (samples read), ``finished`` at the end
``trainer.json``   the trainer's host, pid, plan and a heartbeat, while it reads (a producer stops
                   when no trainer shows life for ``train.online.idle_timeout_s``)
``producer-<p>-of-<N>.json``  each producer's identity (target hash, layer ids, dtype, backend),
                   host, pid and a heartbeat; producer p of N writes the samples i with i % N == p
``train/``, ``eval/``  one sample per shard, in the store's own format (eagle3.store, written by the
                   backends' shard writer: atomic, sha256 sidecars): ``shard-<i>-of-<N>``

The producer (eagle3/online/producer.py) writes the shards of the samples at positions
``consumed ..`` as long as their bytes (not yet read by the trainer) stay within
``train.online.window_bytes``; the trainer (eagle3/online/external.py) reads each, advances
``consumed`` and deletes it unless it is cached. The held-out split is produced first and kept (it
is read at every eval). A restarted producer resumes from what is on disk (a shard that exists is
complete); a restarted trainer writes a new reading order from its checkpoint's step.

The cache (``train.online.cache_bytes``): the first samples of the training split (by index) whose
shards fit the budget are kept in ``<dir>/train`` and read again in later epochs. Once every
training sample is cached the directory is finalized as a store (:func:`finalize_cache`).

This module holds the file names, the sizes both sides count and the small file helpers.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

from ..atomic import atomic_write_json
from ..errors import Eagle3Error
from ..store import ShardSpec, StoreLayout, shard_header

log = logging.getLogger("eagle3.online")

PLAN_FILE = "plan.json"
CONSUMED_FILE = "consumed.json"
TRAINER_FILE = "trainer.json"
PRODUCER_GLOB = "producer-*-of-*.json"

_SIDECAR_BYTES = 512  # a shard's sidecar JSON, rounded up (counted in the window)


class Heartbeat:
    """``record`` with the time written now and every ``every`` seconds from a thread, until
    :meth:`close`: a producer's and a trainer's sign of life. ``write`` is a path (the directory
    protocol: ``producer-<p>-of-<N>.json``, ``trainer.json``, written atomically) or a callable
    taking the record (another transport); a failed write is logged and tried again at the next beat."""

    def __init__(self, write, record: dict, every: float, where: str = ""):
        if isinstance(write, (str, Path)):
            path = Path(write)
            self.where = where or str(path)
            write = lambda rec: atomic_write_json(path, rec)  # noqa: E731
        else:
            self.where = where
        self.write, self.record, self.every = write, record, every
        self.stop = threading.Event()
        self.beat()
        self.thread = threading.Thread(target=self._run, daemon=True, name="eagle3-online-heartbeat")
        self.thread.start()

    def beat(self) -> None:
        self.write(dict(self.record, heartbeat=time.time()))

    def _run(self) -> None:
        while not self.stop.wait(self.every):
            try:
                self.beat()
            except (OSError, Eagle3Error) as e:
                log.warning("online: heartbeat %s not written: %s", self.where, e)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def producer_file(part: int = 0, parts: int = 1) -> str:
    """The heartbeat file of producer ``part`` of ``parts`` (it writes the samples i with i % parts == part)."""
    return f"producer-{part}-of-{parts}.json"


class OnlineError(Eagle3Error):
    """Online training cannot go on: a producer that does not match or does not answer, a window
    too small, a directory that cannot be written."""


def shard_bytes(split: str, i: int, num: int, length: int, layout: StoreLayout) -> int:
    """Bytes on disk of sample ``i``'s one-sample shard (file + sidecar)."""
    shard = ShardSpec(split, i, num, i, [range(int(length))], [range(int(length))])
    return int(shard_header(shard, layout)[1]["__end__"]) + _SIDECAR_BYTES


def largest_micro_batch(lengths: Sequence[int], layout: StoreLayout, micro_batches, cached: int = 0) -> tuple:
    """(bytes, index) of the micro-batch (rows of sample ids) whose uncached samples' shards take the
    most disk at once: what the window must hold for the trainer to read it."""
    N, size, worst, worst_mb = len(lengths), {}, 0, 0
    for m, mb in enumerate(micro_batches):
        ids = {i for row in mb for i in row if i >= cached}
        b = sum(size.setdefault(i, shard_bytes("train", i, N, int(lengths[i]), layout)) for i in ids)
        if b > worst:
            worst, worst_mb = b, m
    return worst, worst_mb


def window_too_small(window_bytes: int, rows: int, need: int, index: int, how: str = "") -> OnlineError:
    """The refusal of a window below one micro-batch (the trainer's, and ``stage=plan``'s)."""
    return OnlineError(f"train.online.window_bytes={window_bytes} is smaller than one micro-batch of "
                       f"train.batch_size={rows} rows: micro-batch {index} needs {need} bytes of hidden states on "
                       f"disk at once{how}; set train.online.window_bytes to at least {need} (a few micro-batches "
                       f"lets the producer run ahead), or lower train.batch_size")


def cached_count(lengths: Sequence[int], layout: StoreLayout, cache_bytes: int, split: str = "train") -> int:
    """How many leading samples (by index) of ``lengths`` fit the cache budget."""
    total, n = 0, 0
    for i, length in enumerate(lengths):
        b = shard_bytes(split, i, len(lengths), int(length), layout)
        if total + b > cache_bytes:
            break
        total += b
        n += 1
    return n


def layout_identity(layout: StoreLayout) -> dict:
    """What producer and trainer must agree on (the shards' bytes depend on it)."""
    return layout.to_json()


def check_writable(path: Path, what: str) -> None:
    """``path`` exists (made if needed) and a file can be written in it; else an OnlineError."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as e:
        raise OnlineError(f"{what} {path} is not writable ({e.strerror or e}): set train.online.dir to a "
                          f"directory this process can write (local NVMe, /dev/shm, a shared filesystem)") from None


def read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def finalize_cache(cache_dir: Path, layout: StoreLayout, lengths) -> bool:
    """Index + store.json over ``cache_dir`` when every training sample's shard is there (then it
    is a store with one sample per shard); False when some are missing."""
    from ..store import finalize_store, missing_shards, shard_ranges

    if missing_shards(cache_dir, {"train": shard_ranges(len(lengths), 1)}):
        return False
    finalize_store(cache_dir, layout, {"train": lengths}, 1)
    return True


def disk_bytes(d: Path) -> int:
    """Bytes of the shards and sidecars under ``d`` (what the window and cache bound)."""
    return sum(f.stat().st_size for f in Path(d).rglob("*") if f.is_file() and f.name.startswith((".shard", "shard")))


def window_ids(order: Sequence[int], position: int, window_bytes: int, nbytes, counts) -> list:
    """The distinct samples at positions ``position ..`` of ``order`` whose bytes not yet read (those
    that ``counts``) stay within ``window_bytes``, in reading order: what producers may have written
    or write now. ``nbytes(i)``: sample i's bytes in the window; ``counts(i)``: whether it takes window
    room (a cached sample the trainer holds already does not)."""
    used, ids, seen = 0, [], set()
    for p in range(position, len(order)):
        i = order[p]
        if i in seen:
            continue
        if counts(i):
            b = nbytes(i)
            if used + b > window_bytes:
                break
            used += b
        seen.add(i)
        ids.append(i)
    return ids


def identity_diff(mine: dict, theirs: dict) -> dict:
    """{key: (mine, theirs)} of the identity entries that differ."""
    theirs = theirs or {}
    return {k: (v, theirs.get(k)) for k, v in mine.items() if theirs.get(k) != v}


# -- the directory protocol's two sides (train.online.transport=dir) -------------------------------------------

class DirTrainerLink:
    """A trainer process's side of the exchange directory: its plan, position and heartbeat in ``dir``
    (``rank-<r>/`` of ``base`` for a trainer of several processes), the shards producers write there,
    and the producers' heartbeats at the top. The cache is the exchange directory itself."""

    transport = "dir"
    setting = "train.online.dir"

    def __init__(self, base: Path, rank: int = 0, world_size: int = 1):
        self.base = Path(base)
        self.dir = self.base if world_size == 1 else self.base / f"rank-{rank}"
        check_writable(self.dir, "the online exchange directory")
        self.where = str(self.dir)
        self.producers_where = str(self.base / PRODUCER_GLOB)

    def attach(self, split: str, store=None) -> None:
        check_writable(self.dir / split, "the online exchange directory")

    def plan_extra(self, cached: int) -> dict:
        return {}

    def write_plan(self, plan: dict) -> None:
        # the position first: a producer that sees the new plan finds its position
        self.write_position(plan["plan_id"], 0, False)
        atomic_write_json(self.dir / PLAN_FILE, plan)

    def write_position(self, plan_id: str, position: int, finished: bool) -> None:
        atomic_write_json(self.dir / CONSUMED_FILE, {"plan_id": plan_id, "position": position, "finished": finished})

    def heartbeat(self, record: dict, every: float) -> Heartbeat:
        return Heartbeat(self.dir / TRAINER_FILE, record, every)

    def producers(self) -> list:
        """[(name, record)] of the producers' heartbeats."""
        out = []
        for f in sorted(self.base.glob(PRODUCER_GLOB)):
            p = read_json(f)
            if p is not None:
                out.append((f.name, p))
        return out

    def _path(self, split: str, i: int, num: int) -> Path:
        from ..store import shard_name

        return self.dir / split / shard_name(i, num)

    def present(self, split: str, i: int, num: int) -> bool:
        return self._path(split, i, num).exists()

    def read(self, split: str, spec, layout: StoreLayout, plan_id: str, cached: bool) -> dict:
        """Sample ``spec.first`` (its one-sample shard spec) as a store item, once :meth:`present`."""
        from ..store import completed_shard, read_shard_item

        path = self._path(split, spec.first, spec.num)
        if split == "train":
            completed_shard(self.dir / split, spec, layout)  # refuses a shard of another layout
        return read_shard_item(path, layout)

    def drop(self, split: str, i: int, num: int) -> None:
        from ..store import sidecar_path

        path = self._path(split, i, num)
        path.unlink(missing_ok=True)
        sidecar_path(path.parent, path.name).unlink(missing_ok=True)

    def finish(self, layout: StoreLayout, lengths, cached_all: bool) -> None:
        import shutil

        shutil.rmtree(self.dir / "eval", ignore_errors=True)  # kept for the evals only
        if cached_all:
            finalize_cache(self.dir, layout, lengths)

    def close(self) -> None:
        pass


class DirProducerLink:
    """A producer's side of the exchange directory ``base``: the trainers' plans and positions (the top,
    or ``rank-<r>/`` of a trainer of several processes), the shards the backend writes there."""

    transport = "dir"
    setting = "train.online.dir"

    def __init__(self, base: Path):
        self.base = Path(base)
        check_writable(self.base, "the online exchange directory")
        self.where = str(self.base)

    def heartbeat(self, part: int, parts: int, record: dict, every: float) -> Heartbeat:
        return Heartbeat(self.base / producer_file(part, parts), record, every)

    def channels(self) -> list:
        return [self.base] + sorted(p for p in self.base.glob("rank-*") if p.is_dir())

    def read(self, chan: Path, name: str) -> Optional[dict]:
        return read_json(chan / {"plan": PLAN_FILE, "consumed": CONSUMED_FILE, "trainer": TRAINER_FILE}[name])

    def eval_todo(self, chan: Path, plan: dict, part: int, parts: int) -> list:
        from ..store import shard_name

        n = int(plan.get("eval", 0))
        return [i for i in range(n) if i % parts == part and not (chan / "eval" / shard_name(i, n)).exists()]

    def window(self, chan: Path, plan: dict, position: int, samples, layout: StoreLayout, part: int,
               parts: int) -> list:
        """The samples of this part to write now (:func:`window_ids` not on disk); removes this part's shards
        that no position in the window needs (read already, or left by an earlier plan) and are not cached.
        A cached sample stays on disk and takes no window room."""
        from ..store import shard_name, sidecar_path

        N, cached = plan["num_samples"], int(plan["cached"])
        ids = window_ids(plan["order"], position, int(plan["window_bytes"]),
                         lambda i: shard_bytes("train", i, N, int(samples.lengths[i]), layout), lambda i: i >= cached)
        todo = [i for i in ids if i % parts == part and not (chan / "train" / shard_name(i, N)).exists()]
        seen = set(ids)
        for f in (chan / "train").glob("shard-*.safetensors"):
            i = int(f.name.split("-")[1])
            if i >= cached and i not in seen and i % parts == part:
                f.unlink(missing_ok=True)
                sidecar_path(f.parent, f.name).unlink(missing_ok=True)
        return todo

    def staging(self, chan: Path) -> Path:
        """Where the backend writes the shards for ``chan``: the exchange directory itself."""
        return chan

    def publish(self, chan: Path, plan: dict, specs: list) -> None:
        """The shards are where the trainer reads them already."""

    def close(self) -> None:
        pass
