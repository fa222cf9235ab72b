"""``train.online.producer=external``, the trainer's side: items are the shards producer processes
(``python -m eagle3 stage=produce``, eagle3/online/producer.py) write into the exchange directory
(eagle3/online/exchange.py). The trainer writes its reading order before it reads, reads each shard
when it is there (a thread reads the next ones ahead), advances its position and deletes what it
read unless it is cached."""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path

from ..atomic import atomic_write_json
from ..store import StoreLayout, one_sample_shard, read_shard_item, shard_name, sidecar_path
from ..train.source import SourceStalled
from .exchange import (
    CONSUMED_FILE,
    PLAN_FILE,
    PRODUCER_GLOB,
    TRAINER_FILE,
    Heartbeat,
    OnlineError,
    cached_count,
    check_writable,
    finalize_cache,
    largest_micro_batch,
    read_json,
    window_too_small,
)
from .hidden_states import OnlineHiddenStates

log = logging.getLogger("eagle3.online")

_READ_AHEAD = 2  # training samples the trainer reads ahead of the loop (the next ones, in order)
WAIT_LOG_S = 30.0  # while it waits for a sample, the trainer says so this often (or twice per timeout_s)


class ProducerTimeout(OnlineError, SourceStalled):
    """No shard arrived and no producer was heard from for ``train.online.timeout_s``."""


class ExternalSource:
    """Shards from producer processes through ``exchange_dir`` (the protocol:
    eagle3/online/exchange.py). With several training processes, rank r has its own ``rank-<r>/`` in it (plan,
    position, shards); the producers' heartbeats stay at the top."""

    on_device = False  # items are read from files into host memory

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
        self._beat = None  # trainer.json, from the first plan until close: the producers see this trainer live
        self._closed = threading.Event()  # close(): a read still waiting gives up at once

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
        worst, worst_mb = largest_micro_batch(store.lengths, self.layout, micro_batches, self.cached)
        if worst > self.ocfg.window_bytes:
            raise window_too_small(self.ocfg.window_bytes, len(micro_batches[worst_mb]), worst, worst_mb)
        self._drop_ahead()
        self._closed.clear()
        self.order, self.pos = order, 0
        self.plan_id = uuid.uuid4().hex
        evals = self.stores.get("eval")
        plan = {"plan_id": self.plan_id, "identity": self.identity, "order": order, "num_samples": N,
                "cached": self.cached, "window_bytes": self.ocfg.window_bytes,
                "eval": len(evals) if evals is not None else 0, "host": socket.gethostname(), "pid": os.getpid()}
        # consumed first: a producer that sees the new plan finds its position
        atomic_write_json(self.dir / CONSUMED_FILE, {"plan_id": self.plan_id, "position": 0, "finished": False})
        atomic_write_json(self.dir / PLAN_FILE, plan)
        if self._beat is None:
            self._beat = Heartbeat(self.dir / TRAINER_FILE, {"host": socket.gethostname(), "pid": os.getpid()},
                                   max(1.0, 10 * self.ocfg.poll_s))
        self._beat.record["plan_id"] = self.plan_id
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
        """Until ``path`` is there; a line every WAIT_LOG_S while it is not, and a ProducerTimeout
        once neither it nor a heartbeat of its producer came for ``timeout_s``."""
        t0 = time.monotonic()
        timeout = self.ocfg.timeout_s
        every = min(WAIT_LOG_S, timeout / 2)
        said = t0
        while not path.exists():
            if self._closed.is_set():
                raise OnlineError(f"online: the read of {what} was given up (the trainer closed its source)")
            beats = [float(p.get("heartbeat", 0)) for p in self._owners(i)]
            now = time.monotonic()
            waited = now - t0
            silent = time.time() - max(beats) if beats else waited
            if waited > timeout and silent > timeout:
                raise ProducerTimeout(f"online training waited {waited:.0f} s for {what} in {self.dir}: "
                                      f"{self._producer_line(i)}. Start the producer on that directory again "
                                      f"(`python -m eagle3 stage=produce` with the trainer's overrides); one that is "
                                      f"only slow (loading its target, a long sample) needs a larger "
                                      f"train.online.timeout_s (now {timeout:g} s)")
            if now - said >= every:
                said = now
                log.warning("online: waiting for %s in %s: none for %.0f s; %s (stops after %g s without a sample "
                            "or a heartbeat, train.online.timeout_s)", what, self.dir, waited, self._producer_line(i),
                            timeout)
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
        from ..store import completed_shard

        i, N = self.order[p], len(store)
        path = self.dir / "train" / shard_name(i, N)
        self._wait(path, i, f"training sample {i} (position {p} of plan {self.plan_id[:8]})")
        spec = one_sample_shard("train", i, N, *store.tokens(i))
        completed_shard(self.dir / "train", spec, self.layout)  # refuses a shard of another layout
        item = read_shard_item(path, self.layout)
        if item["input_ids"].tolist() != list(spec.input_ids[0]):
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
        if store.split == "train":
            self._closed.set()
        self._drop_ahead()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        if store.split == "train" and self._beat is not None:
            self._beat.close()
            self._beat = None
        if store.split == "train" and finished and self.plan_id:
            atomic_write_json(self.dir / CONSUMED_FILE,
                              {"plan_id": self.plan_id, "position": self.pos, "finished": True})
            import shutil

            shutil.rmtree(self.dir / "eval", ignore_errors=True)  # kept for the evals only
            if self.cached == len(store):
                finalize_cache(self.dir, self.layout, store.lengths)
