"""What the train loop reads its hidden states from: :class:`HiddenStateSource`.

Two implement it: a store on disk (eagle3.store.HiddenStates, the extract stage's output) and an
online source (eagle3.online.OnlineHiddenStates, computed while training). The loop and its batches
(loop.py, data.py) use only what is declared here, so neither knows which one it reads.
"""
from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from ..errors import Eagle3Error


class SourceStalled(Eagle3Error):
    """A source gave up waiting for an item that is made elsewhere (an online producer that went
    silent). Raised between two steps, the loop first saves a checkpoint of the last completed step
    and says so in the message: the same command then resumes from it."""


@runtime_checkable
class HiddenStateSource(Protocol):
    """One split of hidden states, as a sequence of samples.

    Item ``i`` is a dict: ``input_ids`` int64 [T], ``loss_mask`` bool [T], ``aux_hidden_states``
    [T, n_aux, H], ``last_hidden_state`` [T, H], ``sample_index``; an fp8 source read raw adds
    ``aux_scales`` [T, n_aux] and ``last_scales`` [T] (float32)."""

    lengths: np.ndarray  # tokens per sample (the epoch's packing and order are computed from them)

    @property
    def on_device(self) -> bool:
        """Items are tensors on the accelerator already: the loop neither pins nor copies them."""
        return False

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> dict: ...

    def expect(self, micro_batches: Sequence) -> None:
        """The order the loop reads the training split in from here on (micro-batches of rows of
        sample ids), told before the first read; a store on disk reads in any order and ignores it."""


def check_source(store, what: str) -> None:
    """``store`` implements :class:`HiddenStateSource`; a TypeError naming what it lacks otherwise."""
    if not isinstance(store, HiddenStateSource):
        missing = [n for n in ("lengths", "on_device", "__len__", "__getitem__", "expect") if not hasattr(store, n)]
        raise TypeError(f"the {what} ({type(store).__name__}) is not an eagle3.train.source.HiddenStateSource: "
                        f"it has no {', '.join(missing)}")
