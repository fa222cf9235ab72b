"""The trainer's side: one split of the prepared dataset as a hidden-state source whose items are
computed while training (:class:`OnlineHiddenStates`), over an :class:`OnlineSource` that makes them:
in this process (eagle3/online/colocated.py) or in producer processes through the exchange
directory (eagle3/online/external.py)."""
from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from ..store import StoreLayout


class OnlineSource(Protocol):
    """Where an :class:`OnlineHiddenStates` gets its items; one serves a run's every split."""

    on_device: bool  # items are tensors on the accelerator already

    def attach(self, store: "OnlineHiddenStates") -> None:
        """``store`` (one split) will read from this source."""

    def expect(self, store: "OnlineHiddenStates", micro_batches: list) -> None:
        """The order ``store`` is read in from here on (micro-batches of rows of sample ids)."""

    def item(self, store: "OnlineHiddenStates", i: int) -> dict:
        """Sample ``i`` of ``store``'s split, as a store item."""

    def close(self, store: "OnlineHiddenStates", finished: bool) -> None:
        """``store`` reads no more; ``finished``: the run trained to its end."""


class OnlineHiddenStates(Sequence):
    """One split of the prepared dataset as a store whose items are computed while training: an
    eagle3.train.source.HiddenStateSource.

    Items are those of ``HiddenStates(fp8="raw")``; ``lengths``, ``layer_ids``, ``hidden_size``,
    ``dtype`` too. ``source`` produces them (:class:`~eagle3.online.colocated.ColocatedSource` or
    :class:`~eagle3.online.external.ExternalSource`). The loop calls :meth:`expect` with its
    micro-batches first; reads must then follow that order (one process, ``train.num_workers=0``)."""

    def __init__(self, split: str, samples, layout: StoreLayout, source: OnlineSource):
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
        return bool(self.source.on_device)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self.source.item(self, int(i))

    def close(self, finished: bool) -> None:
        self.source.close(self, finished)
