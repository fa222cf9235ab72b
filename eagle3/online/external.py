"""``train.online.producer=external``, the trainer's side: items are the one-sample shards producer
processes (``python -m eagle3 stage=produce``, eagle3/online/producer.py) send through the exchange
(``train.online.transport``: the directory, eagle3/online/exchange.py, or Mooncake,
eagle3/online/mooncake_exchange.py). The trainer publishes its reading order before it reads, reads
each sample when it is there (a thread reads the next ones ahead), advances its position and drops
what it read unless it is cached."""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path

from ..store import StoreLayout, one_sample_shard
from ..train.source import SourceStalled
from .exchange import DirTrainerLink, OnlineError, cached_count, identity_diff, largest_micro_batch, window_too_small
from .hidden_states import OnlineHiddenStates

log = logging.getLogger("eagle3.online")

_READ_AHEAD = 2  # training samples the trainer reads ahead of the loop (the next ones, in order)
WAIT_LOG_S = 30.0  # while it waits for a sample, the trainer says so this often (or twice per timeout_s)


class ProducerTimeout(OnlineError, SourceStalled):
    """No shard arrived and no producer was heard from for ``train.online.timeout_s``."""


class ExternalSource:
    """Samples from producer processes through ``exchange``: a trainer link (eagle3/online/exchange.py
    DirTrainerLink, eagle3/online/mooncake_exchange.py MooncakeTrainerLink), or a directory (the
    directory protocol; with several training processes rank r has its own ``rank-<r>/`` in it)."""

    on_device = False  # items are read into host memory

    def __init__(self, exchange, layout: StoreLayout, ocfg, identity: dict, rank: int = 0, world_size: int = 1):
        self.link = DirTrainerLink(exchange, rank, world_size) if isinstance(exchange, (str, Path)) else exchange
        self.layout, self.ocfg = layout, ocfg
        self.identity = identity  # the trainer's expectation: layout + producer settings
        self.rank, self.world_size = rank, world_size
        self.order: list = []
        self.pos = 0
        self.plan_id = ""
        self.cached = 0
        self.stores: dict = {}
        # the next samples are read by a thread while the loop computes (file reads release the GIL)
        self.ahead: dict = {}  # position -> Future of its item
        self._pool = None
        self._beat = None  # the trainer's heartbeat, from the first plan until close: the producers see it live
        self._closed = threading.Event()  # close(): a read still waiting gives up at once
        self.wait_s = 0.0  # how long the loop waited for its next training sample (the read-ahead not done)

    @property
    def dir(self):
        """The directory protocol's exchange directory of this process (None for another transport)."""
        return getattr(self.link, "dir", None)

    def attach(self, store: OnlineHiddenStates) -> None:
        self.stores[store.split] = store
        self.link.attach(store.split, store)
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
                "eval": len(evals) if evals is not None else 0, "host": socket.gethostname(), "pid": os.getpid(),
                "rank": self.rank, "world_size": self.world_size, **self.link.plan_extra(self.cached)}
        self.link.write_plan(plan)
        if self._beat is None:
            self._beat = self.link.heartbeat({"host": socket.gethostname(), "pid": os.getpid()},
                                             max(1.0, 10 * self.ocfg.poll_s))
        self._beat.record["plan_id"] = self.plan_id
        log.info("online: plan %s written to %s: %d samples to read, window %d bytes, %d samples cached",
                 self.plan_id[:8], self.link.where, len(order), self.ocfg.window_bytes, self.cached)

    def _owners(self, i: int) -> list:
        """The records of the producers that write sample ``i`` (by their part); any whose identity
        differs from the trainer's is an error."""
        owners = []
        for name, p in self.link.producers():
            diff = identity_diff(self.identity, p.get("identity", {}))
            if diff:
                diff = {k: (b, a) for k, (a, b) in diff.items()}
                raise OnlineError(f"the producer writing to {self.link.where} (pid {p.get('pid')} on {p.get('host')}, "
                                  f"{name}) does not produce what this trainer needs: {diff} as (producer, "
                                  f"trainer). Start the producer with the trainer's target and extract settings "
                                  f"(`python -m eagle3 stage=produce` with the same overrides)")
            if i % int(p.get("parts", 1)) == int(p.get("part", 0)):
                owners.append(p)
        return owners

    def _producer_line(self, i: int) -> str:
        owners = self._owners(i)
        if not owners:
            return (f"no producer has written {self.link.producers_where} for this sample (none was started on this "
                    f"{'directory' if self.link.transport == 'dir' else 'exchange'}, or not every part of "
                    f"extract.num_shards)")
        return "; ".join(f"the producer part {p.get('part', 0)} of {p.get('parts', 1)} (backend "
                         f"{p.get('identity', {}).get('backend')!r}, pid {p.get('pid')} on host {p.get('host')}) was "
                         f"last heard from {time.time() - float(p.get('heartbeat', 0)):.0f} s ago" for p in owners)

    def _wait(self, split: str, i: int, N: int, what: str) -> None:
        """Until sample ``i`` of ``split`` is there; a line every WAIT_LOG_S while it is not, and a
        ProducerTimeout once neither it nor a heartbeat of its producer came for ``timeout_s``."""
        t0 = time.monotonic()
        timeout = self.ocfg.timeout_s
        every = min(WAIT_LOG_S, timeout / 2)
        said = t0
        while not self.link.present(split, i, N):
            if self._closed.is_set():
                raise OnlineError(f"online: the read of {what} was given up (the trainer closed its source)")
            beats = [float(p.get("heartbeat", 0)) for p in self._owners(i)]
            now = time.monotonic()
            waited = now - t0
            silent = time.time() - max(beats) if beats else waited
            if waited > timeout and silent > timeout:
                raise ProducerTimeout(f"online training waited {waited:.0f} s for {what} in {self.link.where}: "
                                      f"{self._producer_line(i)}. Start the producer on that "
                                      f"{'directory' if self.link.transport == 'dir' else 'exchange'} again "
                                      f"(`python -m eagle3 stage=produce` with the trainer's overrides); one that is "
                                      f"only slow (loading its target, a long sample) needs a larger "
                                      f"train.online.timeout_s (now {timeout:g} s)")
            if now - said >= every:
                said = now
                log.warning("online: waiting for %s in %s: none for %.0f s; %s (stops after %g s without a sample "
                            "or a heartbeat, train.online.timeout_s)", what, self.link.where, waited,
                            self._producer_line(i), timeout)
            time.sleep(self.ocfg.poll_s)

    def item(self, store: OnlineHiddenStates, i: int) -> dict:
        N = len(store)
        if store.split != "train":
            self._wait(store.split, i, N, f"held-out sample {i}")
            return self._checked(store, i, self.link.read(store.split, one_sample_shard(store.split, i, N,
                                                                                        *store.tokens(i)),
                                                          self.layout, self.plan_id, cached=True))
        if self.pos >= len(self.order) or self.order[self.pos] != i:
            raise RuntimeError(f"online: the loop read sample {i} at position {self.pos}, its plan says "
                               f"{self.order[self.pos] if self.pos < len(self.order) else 'nothing more'}")
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(1, thread_name_prefix="eagle3-online-read")
        for p in range(self.pos, min(self.pos + _READ_AHEAD, len(self.order))):
            if p not in self.ahead:
                self.ahead[p] = self._pool.submit(self._read, store, p)
        t0 = time.perf_counter()
        item = self.ahead.pop(self.pos).result()
        self.wait_s += time.perf_counter() - t0
        # dropped before the position advances: a producer that saw the old position counts the
        # sample in its window (and may write it again, which its next look removes), so the samples
        # in the exchange never exceed the window
        nxt = self.pos + 1
        if i >= self.cached and (nxt >= len(self.order) or self.order[nxt] != i):
            self.link.drop("train", i, N)
        self.pos = nxt
        self.link.write_position(self.plan_id, self.pos, False)
        return item

    def _read(self, store: OnlineHiddenStates, p: int) -> dict:
        """The item at position ``p`` once it is there, checked against the prepared sample."""
        i, N = self.order[p], len(store)
        self._wait("train", i, N, f"training sample {i} (position {p} of plan {self.plan_id[:8]})")
        spec = one_sample_shard("train", i, N, *store.tokens(i))
        return self._checked(store, i, self.link.read("train", spec, self.layout, self.plan_id, cached=i < self.cached))

    def _checked(self, store: OnlineHiddenStates, i: int, item: dict) -> dict:
        if item["input_ids"].tolist() != list(store.tokens(i)[0]):
            raise OnlineError(f"{store.split} sample {i} from {self.link.where} holds other tokens than sample {i} of "
                              f"the prepared dataset: the producer reads another prepare run; start it with the "
                              f"trainer's overrides")
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
            self.link.write_position(self.plan_id, self.pos, True)
            self.link.finish(self.layout, store.lengths, self.cached == len(store))
        if store.split == "train":
            self.link.close()
