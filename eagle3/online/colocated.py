"""``train.online.producer=colocated``: the hf backend in the training process computes each
sample when the loop reads it (frozen, inference mode). Nothing touches the disk unless a cache is
asked for."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Optional

import numpy as np

from ..store import StoreLayout, one_sample_shard, read_shard_item, shard_name
from .exchange import cached_count, check_writable, finalize_cache
from .hidden_states import OnlineHiddenStates


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
        self.device = getattr(extractor, "device", None)  # the hf backend's; a test's stand-in may have none
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
                from ..extract.backend import Progress

                shard = one_sample_shard(store.split, i, len(store), ids, mask)
                self.ext.run([shard], self.cache_dir, Progress(len(ids), "", False))
                self.computed += 1
            return self._placed(read_shard_item(path, self.layout))
        self.computed += 1
        return self._compute(i, ids, mask)

    def _placed(self, item: dict) -> dict:
        """A host item on the device its computed items are on (pinned, then copied without a wait)."""
        import torch

        from ..extract.hf_backend import host_to_device

        if not self.on_device:
            return item
        return {k: host_to_device(v, self.device) if isinstance(v, torch.Tensor) else v for k, v in item.items()}

    def _compute(self, i: int, ids, mask) -> dict:
        import torch

        from ..extract.writer import store_rows

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
