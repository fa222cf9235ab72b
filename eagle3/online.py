"""Online training (``train.hidden_states=online``): the draft learns while the target produces its
hidden states; no complete store is ever needed, and disk stays bounded.

The trainer's data order is a pure function of the step (eagle3.train.data.Epochs), so the loop
tells its store, before it reads anything, which samples it will read and in which order
(``OnlineHiddenStates.expect``). Items are exactly a store's items (``HiddenStates(fp8="raw")``),
so the loop does not know where they come from. Every sample's states are computed alone (one
sample per forward, no padding): its bits depend on the sample only, so a resumed run, a cached
sample and an offline store extracted with ``extract.backend=hf extract.batch_size=1`` are
bit-identical.

Producers (``train.online.producer``):

- ``colocated``: the hf backend in the training process computes each sample when the loop reads it
  (frozen, inference mode). Nothing touches the disk unless a cache is asked for.
- ``external``: producer processes (``python -m eagle3 stage=produce`` with the same overrides as
  the trainer, any ``extract.backend``) and the trainer share a directory; the directory is the
  protocol, no server:

  (a trainer of several processes: each rank has the files below in ``rank-<r>/``, its own window)
  ``plan.json``      the trainer's order (sample ids, in reading order), its layout (target hash,
                     layer ids, dtype), the window and the cached samples; rewritten atomically at
                     every (re)start with a new ``plan_id``
  ``consumed.json``  the trainer's position in the order (samples read), ``finished`` at the end
  ``producer-<p>-of-<N>.json``  each producer's identity (target hash, layer ids, dtype, backend),
                     host, pid and a heartbeat; producer p of N writes the samples i with i % N == p
  ``train/``, ``eval/``  one sample per shard, in the store's own format (eagle3.store, written by the
                     backends' shard writer: atomic, sha256 sidecars): ``shard-<i>-of-<N>``

  The producer writes the shards of the samples at positions ``consumed ..`` as long as their bytes
  (not yet read by the trainer) stay within ``train.online.window_bytes``; the trainer reads each,
  advances ``consumed`` and deletes it unless it is cached. The held-out split is produced first
  and kept (it is read at every eval). A restarted producer resumes from what is on disk (a shard
  that exists is complete); a restarted trainer writes a new plan from its checkpoint's step.

The cache (``train.online.cache_bytes``): the first samples of the training split (by index) whose
shards fit the budget are kept in ``<dir>/train`` and read again in later epochs. Once every
training sample is cached the directory is finalized as a store (index.json, store.json) that
``open_hidden_states`` reads. A later ``stage=extract`` of the same states (target, layer ids,
dtypes, backend and its settings, prepare run) takes every shard whose samples a kept cache holds
from it instead of running the target (:func:`fill_from_caches`); a second online run with the
same directory reads it again.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from .atomic import atomic_write_json
from .errors import Eagle3Error
from .store import ShardPlan, StoreLayout, shard_header, shard_name, sidecar_path

log = logging.getLogger("eagle3.online")

PLAN_FILE = "plan.json"
CONSUMED_FILE = "consumed.json"
PRODUCER_GLOB = "producer-*-of-*.json"


def producer_file(part: int = 0, parts: int = 1) -> str:
    """The heartbeat file of producer ``part`` of ``parts`` (it writes the samples i with i % parts == part)."""
    return f"producer-{part}-of-{parts}.json"
_SIDECAR_BYTES = 512  # a shard's sidecar JSON, rounded up (counted in the window)
_READ_AHEAD = 2  # training samples the trainer reads ahead of the loop (the next ones, in order)


class OnlineError(Eagle3Error):
    """Online training cannot go on: a producer that does not match or does not answer, a window
    too small, a directory that cannot be written."""


# -- sizes and identities -------------------------------------------------------------------------

def shard_bytes(split: str, i: int, num: int, length: int, layout: StoreLayout) -> int:
    """Bytes on disk of sample ``i``'s one-sample shard (file + sidecar)."""
    plan = ShardPlan(split, i, num, i, [range(int(length))], [range(int(length))])
    return int(shard_header(plan, layout)[1]["__end__"]) + _SIDECAR_BYTES


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


def read_shard_item(path: Path, layout: StoreLayout, fp8: str = "raw") -> dict:
    """A one-sample shard file of ``layout`` -> a store item (eagle3.store.shard_item, as HiddenStates
    gives it, scales checked), fully in memory (the file may be deleted right after)."""
    from safetensors import safe_open

    from .store import StoreError, shard_item

    with safe_open(str(path), framework="pt") as f:  # one copy out of the page cache per tensor
        t = {k: f.get_tensor(k) for k in f.keys()}
    missing = [n for n in ("aux_scales", "last_scales") if layout.is_fp8 and n not in t]
    if missing:
        raise StoreError(f"fp8 shard {path} has no {missing}: its values cannot be dequantised")
    return shard_item(t.__getitem__, 0, int(t["input_ids"].shape[0]), int(t["sample_index"][0]), layout.is_fp8,
                      fp8, path)


def _one_sample_plan(split: str, i: int, num: int, ids, mask) -> ShardPlan:
    return ShardPlan(split, i, num, i, [list(ids)], [list(mask)])


def finalize_cache(cache_dir: Path, layout: StoreLayout, lengths) -> bool:
    """Index + store.json over ``cache_dir`` when every training sample's shard is there (then it
    is a store with one sample per shard); False when some are missing."""
    from .store import finalize_store, missing_shards, shard_ranges

    if missing_shards(cache_dir, {"train": shard_ranges(len(lengths), 1)}):
        return False
    finalize_store(cache_dir, layout, {"train": lengths}, 1)
    return True


def extract_identity(layout: StoreLayout, target_dtype: str, ecfg) -> tuple:
    """(identity, extract settings) of the states a producer or an extract run with these settings
    computes: what an online run records as its producer and a cache must match to be reused."""
    from .hashing import semantic_dict

    identity = {**layout_identity(layout), "target_dtype": target_dtype, "backend": ecfg.backend}
    extract = {k: v for k, v in semantic_dict(ecfg).items() if k not in ("samples_per_shard", "splits")}
    return identity, extract


def reusable_caches(manifest, prepare_hash: str, identity: dict, extract: dict) -> list:
    """Split directories (``.../train``) of the caches kept by this experiment's online train runs
    whose states are the ones an extract run of ``identity`` / ``extract`` computes from the prepare
    run ``prepare_hash`` (same target, layer ids, dtypes, backend and backend settings)."""
    out = []
    runs = manifest.read()["stages"].get("train", {}).get("runs", {})
    for _, run in sorted(runs.items()):
        f, up = run.get("facts") or {}, run.get("upstream") or {}
        p = f.get("producer") or {}
        if f.get("hidden_states") != "online" or not f.get("cache_dir") or up.get("prepare") != prepare_hash:
            continue
        if {k: p.get(k) for k in identity} != identity or p.get("extract") != extract:
            continue
        d = Path(f["cache_dir"])
        out += [x for x in [d / "train", *sorted(d.glob("rank-*/train"))] if x.is_dir() and x not in out]
    return out


def fill_from_caches(store_dir: Path, samples, layout: StoreLayout, samples_per_shard: int, caches: list, *,
                     num_processes: int = 1, process_index: int = 0, progress: bool = True) -> int:
    """Write the training split's shards (this process's, ``samples_per_shard`` samples each) whose
    every sample one of ``caches`` holds, from the cached states instead of running the target: the
    same bits (a cached sample was computed alone, as extraction with ``extract.batch_size=1``
    computes it), in the store's format through its writer (atomic, digests). Shards already
    complete are left alone. Returns the number of samples taken from the caches."""
    from .extract.backend import Progress
    from .extract.writer import CapturedBatch, ShardWriter
    from .store import completed_shard, is_assigned, shard_ranges

    store_dir = Path(store_dir)
    N = len(samples)

    def cached(i: int) -> Optional[Path]:
        return next((c / shard_name(i, N) for c in caches if (c / shard_name(i, N)).exists()), None)

    todo = []
    ranges = shard_ranges(N, samples_per_shard)
    for k, (first, count) in enumerate(ranges):
        if not caches or not is_assigned(k, num_processes, process_index):
            continue
        paths = [cached(i) for i in range(first, first + count)]
        if any(p is None for p in paths):
            continue
        ids, mask = samples.get(first, first + count)
        plan = ShardPlan("train", k, len(ranges), first, list(ids), list(mask))
        if completed_shard(store_dir / "train", plan, layout) is None:
            todo.append((plan, paths))
    if not todo:
        return 0
    (store_dir / "train").mkdir(parents=True, exist_ok=True)
    bar = Progress(sum(plan.num_tokens for plan, _ in todo), "extract (from the online cache)", progress)
    w = ShardWriter(store_dir, layout)
    try:
        for plan, paths in todo:
            w.begin(plan)
            for j, path in enumerate(paths):
                i = plan.first + j
                completed_shard(path.parent, _one_sample_plan("train", i, N, plan.input_ids[j], plan.loss_mask[j]),
                                layout)  # refuses a shard written for another layout
                item = read_shard_item(path, layout)
                if item["input_ids"].tolist() != list(plan.input_ids[j]):
                    raise OnlineError(f"{path} holds other tokens than training sample {i} of the prepared dataset; "
                                      f"remove that cache directory ({path.parent.parent}) or re-run the online run")
                n = len(plan.input_ids[j])
                w.write(CapturedBatch([(("train", plan.k), j, 0, 0, n)], item["aux_hidden_states"],
                                      item["last_hidden_state"], aux_scales=item.get("aux_scales"),
                                      last_scales=item.get("last_scales")))
                bar.update(n)
            w.end(("train", plan.k))
            w.poll()
        w.close()
    except BaseException:
        w.abort()
        raise
    finally:
        bar.close()
    return sum(plan.num_samples for plan, _ in todo)


# -- the trainer's side ---------------------------------------------------------------------------

class OnlineHiddenStates(Sequence):
    """One split of the prepared dataset as a store whose items are computed while training.

    Items are those of ``HiddenStates(fp8="raw")``; ``lengths``, ``layer_ids``, ``hidden_size``,
    ``dtype`` too. ``source`` produces them (:class:`ColocatedSource` or :class:`ExternalSource`).
    The loop calls :meth:`expect` with its micro-batches first; reads must then follow that order
    (one process, ``train.num_workers=0``)."""

    def __init__(self, split: str, samples, layout: StoreLayout, source):
        self.split, self.samples, self.layout, self.source = split, samples, layout, source
        self.lengths = np.asarray(samples.lengths, dtype=np.int64)
        source.attach(self)

    layer_ids = property(lambda self: tuple(self.layout.layer_ids))
    last_layer_id = property(lambda self: self.layout.last_layer_id)
    hidden_size = property(lambda self: self.layout.hidden_size)
    dtype = property(lambda self: self.layout.dtype)
    is_fp8 = property(lambda self: self.layout.is_fp8)

    def __len__(self) -> int:
        return len(self.lengths)

    def tokens(self, i: int) -> tuple:
        ids, mask = self.samples.get(int(i), int(i) + 1)
        return list(ids[0]), list(mask[0])

    def expect(self, micro_batches: list) -> None:
        """The loop's reading order from here on: micro-batches of rows of sample ids."""
        self.source.expect(self, micro_batches)

    @property
    def on_device(self) -> bool:
        """Items are tensors on the accelerator already (the loop must not pin them)."""
        return bool(getattr(self.source, "on_device", False))

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self.source.item(self, int(i))

    def close(self, finished: bool) -> None:
        self.source.close(self, finished)


class ColocatedSource:
    """The hf backend in this process computes each sample when it is read; cached samples (the
    leading ones within ``cache_bytes``) are written once to ``cache_dir/train`` and read back.

    On a GPU the items stay on the target's device (``on_device``): the states never go through host
    memory and reading one makes the host wait for nothing, so the loop can queue the next forward
    and training step while the device works. Reads are serialised (the loop's prefetch thread reads
    training items while its main thread may read held-out ones for an eval)."""

    def __init__(self, extractor, layout: StoreLayout, cache_dir: Optional[Path], cache_bytes: int):
        self.ext, self.layout = extractor, layout
        self.cache_dir, self.cache_bytes = cache_dir, cache_bytes
        self.cached: dict[str, int] = {}
        self.computed = 0  # samples computed (the tests count them)
        self.device = getattr(extractor, "device", None)
        self.on_device = getattr(self.device, "type", "cpu") == "cuda"
        self._lock = threading.Lock()

    def attach(self, store: OnlineHiddenStates) -> None:
        n = 0
        if store.split == "train" and self.cache_bytes > 0:
            n = cached_count(store.lengths, self.layout, self.cache_bytes)
            check_writable(self.cache_dir / "train", "the online cache directory")
        self.cached[store.split] = n

    def expect(self, store, micro_batches) -> None:
        pass  # computed on demand

    def item(self, store: OnlineHiddenStates, i: int) -> dict:
        with self._lock:
            return self._item(store, i)

    def _item(self, store: OnlineHiddenStates, i: int) -> dict:
        ids, mask = store.tokens(i)
        if i < self.cached.get(store.split, 0):
            path = self.cache_dir / store.split / shard_name(i, len(store))
            if not path.exists():
                from .extract.backend import Progress

                plan = _one_sample_plan(store.split, i, len(store), ids, mask)
                self.ext.run([plan], self.cache_dir, Progress(len(ids), "", False))
                self.computed += 1
            return self._placed(read_shard_item(path, self.layout))
        self.computed += 1
        return self._compute(i, ids, mask)

    def _placed(self, item: dict) -> dict:
        """A host item on the device its computed items are on (pinned, then copied without a wait)."""
        import torch

        from .extract.hf_backend import host_to_device

        if not self.on_device:
            return item
        return {k: host_to_device(v, self.device) if isinstance(v, torch.Tensor) else v for k, v in item.items()}

    def _compute(self, i: int, ids, mask) -> dict:
        import torch

        from .extract.writer import store_rows

        aux, last = self.ext._forward([(0, np.asarray(ids, dtype=np.int64))])
        with torch.inference_mode():
            av, lv, as_, ls = store_rows(aux, last, self.layout)
        item = self._placed({"input_ids": torch.as_tensor(np.asarray(ids, dtype=np.int64)),
                             "loss_mask": torch.as_tensor(np.asarray(mask, dtype=bool)), "sample_index": i})
        # clone(): the loop owns the item (a plain tensor outside inference mode); on a CPU it is the
        # only copy, on a GPU it stays there (no host round trip)
        item.update(aux_hidden_states=av.clone(), last_hidden_state=lv.clone())
        if as_ is not None:
            item.update(aux_scales=as_.float().clone(), last_scales=ls.float().clone())
        return item

    def close(self, store, finished: bool) -> None:
        if store.split == "train" and finished and self.cached.get("train", 0) == len(store):
            finalize_cache(self.cache_dir, self.layout, store.lengths)


class ExternalSource:
    """Shards from producer processes through ``exchange_dir`` (the protocol in the module
    docstring). With several training processes, rank r has its own ``rank-<r>/`` in it (plan,
    position, shards); the producers' heartbeats stay at the top."""

    def __init__(self, exchange_dir: Path, layout: StoreLayout, ocfg, identity: dict, rank: int = 0,
                 world_size: int = 1):
        self.base = Path(exchange_dir)
        self.dir = self.base if world_size == 1 else self.base / f"rank-{rank}"
        self.layout, self.ocfg = layout, ocfg
        self.identity = identity  # the trainer's expectation: layout + producer settings
        check_writable(self.dir, "the online exchange directory")
        self.order: list = []
        self.pos = 0
        self.plan_id = ""
        self.cached = 0
        self.stores: dict = {}
        # the next samples are read by a thread while the loop computes (file reads release the GIL)
        self.ahead: dict = {}  # position -> Future of its item
        self._pool = None

    def attach(self, store: OnlineHiddenStates) -> None:
        self.stores[store.split] = store
        check_writable(self.dir / store.split, "the online exchange directory")
        if store.split == "train":
            self.cached = cached_count(store.lengths, self.layout, self.ocfg.cache_bytes)

    def expect(self, store: OnlineHiddenStates, micro_batches) -> None:
        if store.split != "train":
            return
        N = len(store)
        order = [i for mb in micro_batches for row in mb for i in row]
        size = {}
        worst, worst_mb = 0, 0
        for m, mb in enumerate(micro_batches):
            ids = {i for row in mb for i in row if i >= self.cached}
            b = sum(size.setdefault(i, shard_bytes("train", i, N, int(store.lengths[i]), self.layout)) for i in ids)
            if b > worst:
                worst, worst_mb = b, m
        if worst > self.ocfg.window_bytes:
            raise OnlineError(f"train.online.window_bytes={self.ocfg.window_bytes} is smaller than one micro-batch: "
                              f"micro-batch {worst_mb} needs {worst} bytes of hidden states on disk at once; set "
                              f"train.online.window_bytes to at least {worst} (a few micro-batches lets the producer "
                              f"run ahead)")
        self._drop_ahead()
        self.order, self.pos = order, 0
        self.plan_id = uuid.uuid4().hex
        evals = self.stores.get("eval")
        plan = {"plan_id": self.plan_id, "identity": self.identity, "order": order, "num_samples": N,
                "cached": self.cached, "window_bytes": self.ocfg.window_bytes,
                "eval": len(evals) if evals is not None else 0, "host": socket.gethostname(), "pid": os.getpid()}
        # consumed first: a producer that sees the new plan finds its position
        atomic_write_json(self.dir / CONSUMED_FILE, {"plan_id": self.plan_id, "position": 0, "finished": False})
        atomic_write_json(self.dir / PLAN_FILE, plan)
        log.info("online: plan %s written to %s: %d samples to read, window %d bytes, %d samples cached",
                 self.plan_id[:8], self.dir, len(order), self.ocfg.window_bytes, self.cached)

    def _owners(self, i: int) -> list:
        """The records of the producers that write sample ``i`` (by their part); any whose identity
        differs from the trainer's is an error."""
        owners = []
        for f in sorted(self.base.glob(PRODUCER_GLOB)):
            p = read_json(f)
            if p is None:
                continue
            theirs = p.get("identity", {})
            diff = {k: (theirs.get(k), v) for k, v in self.identity.items() if theirs.get(k) != v}
            if diff:
                raise OnlineError(f"the producer writing to {self.base} (pid {p.get('pid')} on {p.get('host')}, "
                                  f"{f.name}) does not produce what this trainer needs: {diff} as (producer, "
                                  f"trainer). Start the producer with the trainer's target and extract settings "
                                  f"(`python -m eagle3 stage=produce` with the same overrides)")
            if i % int(p.get("parts", 1)) == int(p.get("part", 0)):
                owners.append(p)
        return owners

    def _producer_line(self, i: int) -> str:
        owners = self._owners(i)
        if not owners:
            return (f"no producer has written {self.base / PRODUCER_GLOB} for this sample (none was started on this "
                    f"directory, or not every part of extract.num_shards)")
        return "; ".join(f"the producer part {p.get('part', 0)} of {p.get('parts', 1)} (backend "
                         f"{p.get('identity', {}).get('backend')!r}, pid {p.get('pid')} on host {p.get('host')}) was "
                         f"last heard from {time.time() - float(p.get('heartbeat', 0)):.0f} s ago" for p in owners)

    def _wait(self, path: Path, i: int, what: str) -> None:
        t0 = time.monotonic()
        while not path.exists():
            beats = [float(p.get("heartbeat", 0)) for p in self._owners(i)]
            waited = time.monotonic() - t0
            silent = time.time() - max(beats) if beats else waited
            if waited > self.ocfg.timeout_s and silent > self.ocfg.timeout_s:
                raise OnlineError(f"online training waited {waited:.0f} s for {what} in {self.dir}: "
                                  f"{self._producer_line(i)}. Restart the producer on that directory "
                                  f"(`python -m eagle3 stage=produce` with the trainer's overrides) and then this "
                                  f"run (it resumes from its last checkpoint); train.online.timeout_s="
                                  f"{self.ocfg.timeout_s}")
            time.sleep(self.ocfg.poll_s)

    def item(self, store: OnlineHiddenStates, i: int) -> dict:
        N = len(store)
        path = self.dir / store.split / shard_name(i, N)
        if store.split != "train":
            self._wait(path, i, f"held-out sample {i}")
            return read_shard_item(path, self.layout)
        if self.pos >= len(self.order) or self.order[self.pos] != i:
            raise RuntimeError(f"online: the loop read sample {i} at position {self.pos}, its plan says "
                               f"{self.order[self.pos] if self.pos < len(self.order) else 'nothing more'}")
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(1, thread_name_prefix="eagle3-online-read")
        for p in range(self.pos, min(self.pos + _READ_AHEAD, len(self.order))):
            if p not in self.ahead:
                self.ahead[p] = self._pool.submit(self._read, store, p)
        item = self.ahead.pop(self.pos).result()
        # deleted before the position advances: a producer that saw the old position counts the
        # sample in its window (and may write it again, which its next look removes), so the shards
        # on disk never exceed the window
        nxt = self.pos + 1
        if i >= self.cached and (nxt >= len(self.order) or self.order[nxt] != i):
            path.unlink(missing_ok=True)
            sidecar_path(path.parent, path.name).unlink(missing_ok=True)
        self.pos = nxt
        atomic_write_json(self.dir / CONSUMED_FILE, {"plan_id": self.plan_id, "position": self.pos, "finished": False})
        return item

    def _read(self, store: OnlineHiddenStates, p: int) -> dict:
        """The item at position ``p`` once its shard is there, checked against the prepared sample."""
        from .store import completed_shard

        i, N = self.order[p], len(store)
        path = self.dir / "train" / shard_name(i, N)
        self._wait(path, i, f"training sample {i} (position {p} of plan {self.plan_id[:8]})")
        plan = _one_sample_plan("train", i, N, *store.tokens(i))
        completed_shard(self.dir / "train", plan, self.layout)  # refuses a shard of another layout
        item = read_shard_item(path, self.layout)
        if item["input_ids"].tolist() != list(plan.input_ids[0]):
            raise OnlineError(f"{path} holds other tokens than sample {i} of the prepared dataset: the producer "
                              f"reads another prepare run; start it with the trainer's overrides")
        return item

    def _drop_ahead(self) -> None:
        for f in self.ahead.values():
            f.cancel()
        for f in self.ahead.values():
            if not f.cancelled():
                try:
                    f.result()
                except Exception:  # a read for the old plan: its error no longer matters
                    pass
        self.ahead.clear()

    def close(self, store, finished: bool) -> None:
        self._drop_ahead()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        if store.split == "train" and finished and self.plan_id:
            atomic_write_json(self.dir / CONSUMED_FILE,
                              {"plan_id": self.plan_id, "position": self.pos, "finished": True})
            import shutil

            shutil.rmtree(self.dir / "eval", ignore_errors=True)  # kept for the evals only
            if self.cached == len(store):
                finalize_cache(self.dir, self.layout, store.lengths)


# -- the producer's side --------------------------------------------------------------------------

class _Heartbeat:
    def __init__(self, path: Path, record: dict, every: float):
        self.path, self.record, self.every = path, record, every
        self.stop = threading.Event()
        self.beat()
        self.thread = threading.Thread(target=self._run, daemon=True, name="eagle3-producer-heartbeat")
        self.thread.start()

    def beat(self) -> None:
        atomic_write_json(self.path, dict(self.record, heartbeat=time.time()))

    def _run(self) -> None:
        while not self.stop.wait(self.every):
            try:
                self.beat()
            except OSError as e:
                log.warning("online producer: heartbeat not written: %s", e)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def produce(exchange_dir, splits: dict, layout: StoreLayout, extractor, identity: dict, *, poll_s: float = 0.05,
            idle_timeout_s: float = 0.0, progress: bool = True, part: int = 0, parts: int = 1) -> dict:
    """The producer loop: serve the trainer's plans in ``exchange_dir`` until it says it finished.

    Several producers share a directory as ``parts`` (``stage=produce extract.num_shards=N
    extract.shard_index=p``): part p writes the samples i with i % N == p, each counting every
    sample of the window (so together they stay within it) and removing only its own.

    ``splits``: {"train": samples, "eval": samples} of the prepared dataset (``lengths``, ``get``);
    ``extractor``: a built backend (``Extractor.run(plans, dir, progress)``); ``identity``: what
    this producer computes (the trainer checks it). ``idle_timeout_s`` > 0: give up when no plan
    appears for that long. Returns counts (samples written, plans served)."""
    from tqdm.auto import tqdm

    from .extract.backend import Progress

    d = Path(exchange_dir)
    check_writable(d, "the online exchange directory")
    if not 0 <= part < parts:
        raise OnlineError(f"producer part {part} of {parts}: the part must be in [0, {parts})")
    beat = _Heartbeat(d / producer_file(part, parts), {"identity": identity, "host": socket.gethostname(),
                                                        "pid": os.getpid(), "part": part, "parts": parts},
                      max(1.0, 10 * poll_s))
    stats = {"written": 0, "plans": 0}
    bar = tqdm(desc="produce", unit="sample", disable=not progress)
    chans: dict = {}  # trainer directory (the top, or rank-<r>/ of a multi-process trainer) -> its state
    try:
        t_idle = time.monotonic()
        while True:
            work, waiting = [], False
            for cd in [d] + sorted(p for p in d.glob("rank-*") if p.is_dir()):
                plan = read_json(cd / PLAN_FILE)
                if plan is None:
                    continue
                ch = chans.setdefault(cd, {"plan_id": None, "served": set(), "done": False})
                if plan["plan_id"] != ch["plan_id"]:
                    ch["plan_id"], ch["done"] = plan["plan_id"], False
                    stats["plans"] += 1
                    _check_plan(plan, identity, cd, splits)
                    log.info("online producer: plan %s in %s: %d samples, window %d bytes", ch["plan_id"][:8], cd,
                             len(plan["order"]), plan["window_bytes"])
                    _produce_eval(cd, plan, splits, layout, extractor, stats, part, parts)
                consumed = read_json(cd / CONSUMED_FILE) or {}
                if consumed.get("plan_id") != ch["plan_id"]:
                    waiting = True
                    continue
                if consumed.get("finished"):
                    # a plan finished before this producer saw it unfinished is an earlier run's: not an end
                    ch["done"] = ch["plan_id"] in ch["served"]
                    continue
                ch["served"].add(ch["plan_id"])
                waiting = True
                todo = _window(cd, plan, int(consumed["position"]), splits["train"], layout, part, parts)
                if todo:
                    work.append((cd, plan["num_samples"], todo))
            served = [ch for ch in chans.values() if ch["served"]]
            if served and not waiting and all(ch["done"] for ch in served):
                log.info("online producer: every trainer finished (%s)", ", ".join(str(c) for c in chans))
                return stats
            if not work:
                if not chans and idle_timeout_s and time.monotonic() - t_idle > idle_timeout_s:
                    raise OnlineError(f"no trainer wrote {d / PLAN_FILE} within {idle_timeout_s:.0f} s")
                time.sleep(poll_s)
                continue
            for cd, N, todo in work:
                plans = []
                for i in todo:
                    ids, mask = splits["train"].get(i, i + 1)
                    plans.append(_one_sample_plan("train", i, N, ids[0], mask[0]))
                extractor.run(plans, cd, Progress(sum(p.num_tokens for p in plans), "", False))
                stats["written"] += len(plans)
                bar.update(len(plans))
    finally:
        bar.close()
        beat.close()


def _check_plan(plan: dict, identity: dict, d: Path, splits: dict) -> None:
    theirs = plan.get("identity", {})
    diff = {k: (v, theirs.get(k)) for k, v in identity.items() if theirs.get(k) != v}
    if diff:
        raise OnlineError(f"the trainer's plan in {d} (pid {plan.get('pid')} on {plan.get('host')}) needs other "
                          f"hidden states than this producer computes: {diff} as (producer, trainer). Start the "
                          f"producer with the trainer's overrides")
    if plan["num_samples"] != len(splits["train"]):
        raise OnlineError(f"the trainer's plan in {d} is over {plan['num_samples']} training samples, this producer's "
                          f"prepared dataset has {len(splits['train'])}: they read different prepare runs")


def _produce_eval(d: Path, plan: dict, splits: dict, layout: StoreLayout, extractor, stats: dict, part: int = 0,
                  parts: int = 1) -> None:
    from .extract.backend import Progress

    n = int(plan.get("eval", 0))
    if not n:
        return
    todo = [i for i in range(n) if i % parts == part and not (d / "eval" / shard_name(i, n)).exists()]
    plans = []
    for i in todo:
        ids, mask = splits["eval"].get(i, i + 1)
        plans.append(_one_sample_plan("eval", i, n, ids[0], mask[0]))
    if plans:
        extractor.run(plans, d, Progress(sum(p.num_tokens for p in plans), "", False))
        stats["written"] += len(plans)


def _window(d: Path, plan: dict, position: int, samples, layout: StoreLayout, part: int = 0, parts: int = 1) -> list:
    """The samples of this part to write now: those at positions ``position ..`` not on disk, as
    long as the bytes not yet read (on disk or about to be, of every part) stay within the window;
    removes this part's shards that no position in the window needs (read already, or left by an
    earlier plan) and that are not cached."""
    order, N, cached = plan["order"], plan["num_samples"], int(plan["cached"])
    window, used, todo, seen = int(plan["window_bytes"]), 0, [], set()
    for p in range(position, len(order)):
        i = order[p]
        if i in seen:
            continue
        present = (d / "train" / shard_name(i, N)).exists()
        if i >= cached:
            b = shard_bytes("train", i, N, int(samples.lengths[i]), layout)
            if used + b > window:
                break
            used += b
        seen.add(i)
        if not present and i % parts == part:
            todo.append(i)
    # what is on disk and not needed within the window: gone (a cached sample stays)
    for f in (d / "train").glob("shard-*.safetensors"):
        i = int(f.name.split("-")[1])
        if i >= cached and i not in seen and i % parts == part:
            f.unlink(missing_ok=True)
            sidecar_path(f.parent, f.name).unlink(missing_ok=True)
    return todo


def disk_bytes(d: Path) -> int:
    """Bytes of the shards and sidecars under ``d`` (what the window and cache bound)."""
    return sum(f.stat().st_size for f in Path(d).rglob("*") if f.is_file() and f.name.startswith((".shard", "shard")))


# -- the stages' common setup ---------------------------------------------------------------------

class OnlineRun:
    """What ``stage=train`` (online) and ``stage=produce`` both derive from the config and the
    manifest: the target, the prepare run, the layout the producer must write, the train job (its
    config hash names the run and the default exchange directory) and the prepared splits."""

    def __init__(self, cfg, manifest):
        from .artifacts import DATASET_DIR
        from .extract import DatasetSamples
        from .extract.checks import refuse_known_bad
        from .extract.layout import check_tokenizer, derive_store_layout
        from .hashing import semantic_dict
        from .target import resolve

        tcfg, ecfg, ocfg = cfg.train, cfg.extract, cfg.train.online
        self.cfg, self.ocfg = cfg, ocfg
        self.target = target = resolve(cfg.target, cfg.workspace)
        self.upstream = manifest.consume_upstream("train", target.identity(), only=("prepare",))
        self.prep = prep = self.upstream["prepare"]
        check_tokenizer(prep, target)
        if ocfg.producer == "colocated" and ecfg.backend != "hf":
            raise OnlineError(f"train.online.producer=colocated runs the target with the hf backend inside the "
                              f"training process, but extract.backend={ecfg.backend}: set extract.backend=hf, or "
                              f"train.online.producer=external to use {ecfg.backend} engines in their own processes "
                              f"(`python -m eagle3 stage=produce`)")
        import datasets

        ds = datasets.load_from_disk(str(prep.path(DATASET_DIR)))
        prepared = {s: DatasetSamples(ds[s]) for s in ds}
        # the store extract would write, from the splits it would read (and the training split, which
        # online training always reads): the same refusals as stage=extract
        derived = derive_store_layout(ecfg, target, cfg.target.dtype, {s: v.lengths for s, v in prepared.items()},
                                      also=("train",))
        self.layer_ids = layer_ids = list(derived.layer_ids)
        refuse_known_bad(target.config, ecfg.backend, layer_ids)
        self.target_dtype, self.layout, self.max_model_len = derived.target_dtype, derived.layout, derived.max_model_len
        # what the producer's numbers depend on: in the config hash, checked between the processes
        self.identity, extract = extract_identity(self.layout, self.target_dtype, ecfg)
        self.producer = {**self.identity, "placement": ocfg.producer, "extract": extract}
        config = {"train": semantic_dict(tcfg), "layer_ids": layer_ids, "hidden_states": "online",
                  "producer": {**self.identity, "extract": extract}}
        self.job = manifest.start("train", config=config, target=target.identity(), inputs=self.upstream)
        self.dir = Path(ocfg.dir).expanduser().resolve() if ocfg.dir else self.job.out_dir / "online"
        self.splits = {"train": prepared["train"]}
        if "eval" in derived.splits and len(prepared["eval"]):
            self.splits["eval"] = prepared["eval"]

    def extractor(self):
        """The producer's backend with the target loaded (``extract.*``); the hf backend on this
        process's GPU under torchrun / accelerate launch when ``extract.device=auto``."""
        import dataclasses

        from .extract.backend import make_extractor

        ecfg = self.cfg.extract
        if ecfg.backend == "hf" and ecfg.device == "auto" and "LOCAL_RANK" in os.environ:
            import torch

            if torch.cuda.is_available():
                ecfg = dataclasses.replace(ecfg, device=f"cuda:{os.environ['LOCAL_RANK']}")
        return make_extractor(ecfg.backend, self.target.path, self.layout, self.target_dtype, ecfg,
                              self.max_model_len, self.dir)

    def stores(self, world_size: int, rank: int = 0) -> tuple:
        """(train store, eval store or None) for the trainer: OnlineHiddenStates over this run's source."""
        ocfg, tcfg = self.ocfg, self.cfg.train
        if tcfg.num_workers:
            raise OnlineError(f"train.hidden_states=online reads samples in the loop's order in the training "
                              f"process: set train.num_workers=0 (it is {tcfg.num_workers})")
        if ocfg.producer == "colocated":
            if ocfg.cache_bytes:
                check_writable(self.dir, "the online cache directory")
            source = ColocatedSource(self.extractor(), self.layout, self.dir, ocfg.cache_bytes)
        else:
            source = ExternalSource(self.dir, self.layout, ocfg, self.identity, rank=rank, world_size=world_size)
        train = OnlineHiddenStates("train", self.splits["train"], self.layout, source)
        ev = OnlineHiddenStates("eval", self.splits["eval"], self.layout, source) if "eval" in self.splits else None
        return train, ev
