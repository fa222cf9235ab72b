"""Online training (``train.hidden_states=online``): the draft learns while the target produces its
hidden states; no complete store is ever needed, and disk stays bounded.

The trainer's data order is a pure function of the step (eagle3.train.data.Epochs), so the loop
tells its hidden-state source, before it reads anything, which samples it will read and in which
order (``OnlineHiddenStates.expect``, eagle3.train.source.HiddenStateSource). Items are exactly a
store's items (``HiddenStates(fp8="raw")``), so the loop does not know where they come from. Every
sample's states are computed alone (one sample per forward, no padding): its bits depend on the
sample only, so a resumed run, a cached sample and an offline store extracted with
``extract.backend=hf extract.batch_size=1`` are bit-identical.

Producers (``train.online.producer``):

- ``colocated`` (colocated.py): the hf backend in the training process computes each sample when
  the loop reads it. Nothing touches the disk unless a cache is asked for.
- ``external``: producer processes (``python -m eagle3 stage=produce`` with the same overrides as
  the trainer, any ``extract.backend``; producer.py) and the trainer (external.py) exchange
  one-sample shards, the reading order, positions and heartbeats through ``train.online.transport``:
  ``dir``, a directory (one host or a shared filesystem; the directory is the protocol, no server:
  exchange.py), or ``mooncake``, a Mooncake Store (hosts that share no filesystem; TCP or RDMA; every
  message sealed, with a shared secret authenticated: mooncake_exchange.py over mooncake.py).

The cache (``train.online.cache_bytes``): the first training samples whose shards fit the budget
are kept and read again in later epochs; once every training sample is cached the directory is a
store ``open_hidden_states`` reads. A later ``stage=extract`` of the same states takes every shard
whose samples a kept cache holds from it instead of running the target
(eagle3.extract.reuse.fill_from_caches, which imports nothing of this package).

Modules, one concern each:

- exchange.py: the sizes both sides count, the window, OnlineError, the directory protocol's two sides
- mooncake.py: a checked Mooncake Store client and master process
- mooncake_exchange.py: the Mooncake protocol's two sides and its sealed messages
- hidden_states.py: OnlineHiddenStates (one split as a hidden-state source) and the OnlineSource protocol its producers implement
- colocated.py: ColocatedSource (the target in the training process)
- external.py: ExternalSource (shards from producer processes, the trainer's side of the exchange)
- producer.py: produce(), the producer loop (``stage=produce``)
- run.py: OnlineRun, what the train and produce stages both set up
"""
from __future__ import annotations

from .colocated import ColocatedSource
from .exchange import (
    CONSUMED_FILE,
    PLAN_FILE,
    PRODUCER_GLOB,
    OnlineError,
    cached_count,
    check_writable,
    disk_bytes,
    finalize_cache,
    layout_identity,
    producer_file,
    read_json,
    shard_bytes,
)
from .external import ExternalSource
from .hidden_states import OnlineHiddenStates, OnlineSource
from .producer import produce
from .run import OnlineRun

__all__ = ["OnlineError", "OnlineRun", "OnlineHiddenStates", "OnlineSource", "ColocatedSource", "ExternalSource",
           "produce", "shard_bytes", "cached_count", "disk_bytes", "check_writable", "finalize_cache",
           "layout_identity", "producer_file", "read_json", "PLAN_FILE", "CONSUMED_FILE", "PRODUCER_GLOB"]
