"""Batches for the train loop: epoch orders, sequence packing, collation, sharding over ranks.

An epoch's order is a pure function of (sample lengths, seed, epoch, row length, packing): samples
in a seeded random order, packed greedily into rows of at most ``max_len`` tokens (or one sample
per row without packing). A global optimizer step takes the next ``G = batch_size * grad_accum *
world_size`` rows; rank r's accumulation micro-batch a is rows ``[(a*W + r)*B, +B)`` of them. So
the global batch of a step does not depend on how it is split over processes, and the data
position of a resumed run is just the step number (``Epochs`` maps it to an epoch and a step
within it, epoch after epoch).
"""
from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np
import torch

from .source import HiddenStateSource
from .ttt import head_rows


@dataclass
class EpochOrder:
    rows: List[List[int]]  # sample indices per row

    def micro_batch(self, step_in_epoch: int, accum_index: int, rank: int, batch_size: int,
                    grad_accum: int, world_size: int) -> List[List[int]]:
        g = batch_size * grad_accum * world_size
        first = step_in_epoch * g + (accum_index * world_size + rank) * batch_size
        return self.rows[first:first + batch_size]


def epoch_order(lengths: Sequence[int], max_len: int, seed: int, epoch: int, packing: bool,
                shuffle: bool = True) -> EpochOrder:
    """Rows of sample indices for one epoch. Samples with fewer than 3 tokens (no loss position:
    step 0 at index t predicts token t+2) are left out; longer samples are cut to ``max_len``."""
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.arange(len(lengths))
    if shuffle:
        order = np.random.default_rng([seed, epoch]).permutation(len(lengths))
    rows, cur, cur_len = [], [], 0
    for i in order.tolist():
        n = min(int(lengths[i]), max_len)
        if n < 3:
            continue
        if not packing:
            rows.append([i])
            continue
        if cur and cur_len + n > max_len:
            rows.append(cur)
            cur, cur_len = [], 0
        cur.append(i)
        cur_len += n
    if cur:
        rows.append(cur)
    return EpochOrder(rows)


def steps_per_epoch(order: EpochOrder, batch_size: int, grad_accum: int, world_size: int) -> int:
    return len(order.rows) // (batch_size * grad_accum * world_size)


class Epochs:
    """The run's epoch orders, each made when first needed (from the sample lengths alone): which
    epoch and step within it a global optimizer step is, and the micro-batches from any step on."""

    def __init__(self, lengths: Sequence[int], tcfg, world_size: int):
        self.lengths, self.tcfg, self.world = lengths, tcfg, world_size
        self.orders, self.starts = [], [0]  # starts[e]: the global step epoch e begins at

    def order(self, epoch: int) -> EpochOrder:
        while len(self.orders) <= epoch:
            e = len(self.orders)
            p = epoch_order(self.lengths, self.tcfg.max_seq_len, self.tcfg.seed, e, self.tcfg.packing)
            n = steps_per_epoch(p, self.tcfg.batch_size, self.tcfg.grad_accum, self.world)
            if n == 0:
                raise ValueError(f"the training split has {len(p.rows)} rows of up to {self.tcfg.max_seq_len} tokens, "
                                 f"fewer than one global batch (batch_size {self.tcfg.batch_size} x grad_accum "
                                 f"{self.tcfg.grad_accum} x {self.world} processes): lower train.batch_size or "
                                 f"train.grad_accum, or extract more samples")
            self.orders.append(p)
            self.starts.append(self.starts[-1] + n)
        return self.orders[epoch]

    def total_steps(self) -> int:
        if self.tcfg.max_steps > 0:
            return self.tcfg.max_steps
        self.order(self.tcfg.epochs - 1)
        return self.starts[self.tcfg.epochs]

    def locate(self, step: int) -> tuple:
        """(epoch, step within that epoch) of a global step."""
        e = 0
        while True:
            self.order(e)
            if step < self.starts[e + 1]:
                return e, step - self.starts[e]
            e += 1

    def micro_batches(self, start: int, total: int, rank: int) -> List[List[List[int]]]:
        """Process ``rank``'s micro-batches (rows of sample indices) of steps ``start .. total-1``,
        ``grad_accum`` per step, in order."""
        t = self.tcfg
        rows = []
        for s in range(start, total):
            e, k = self.locate(s)
            order = self.order(e)
            for a in range(t.grad_accum):
                rows.append(order.micro_batch(k, a, rank, t.batch_size, t.grad_accum, self.world))
        return rows


def collate(rows: List[List[dict]], max_len: int, pad_to_multiple: int = 1, pin: bool = False,
            ids: Optional[List[List[int]]] = None) -> dict:
    """Rows of store items -> batch tensors [B, T]: a packed row holds several documents with
    their own positions (from 0) and document ids; padding has doc id -1 and no loss.

    Items of an fp8 store read raw (``HiddenStates(fp8="raw")``) stay float8 here, with their
    scales: ``aux_scales`` float32 [B, T, n_aux], ``last_scales`` [B, T] (1 on padding);
    ``model_inputs`` dequantises them on the device, so host memory never holds a wider copy.

    The batch is built where the items are (host memory, or the GPU for an online colocated
    producer's items); ``pin``: host batches in pinned memory, ready for an async copy to the GPU
    (instead of the DataLoader copying them into pinned memory afterwards). ``ids``: the items'
    sample ids, row by row; then ``docs`` holds each row's (sample id, tokens kept) in order (not a
    tensor: it stays on the host), what eagle3.train.target_head.InVocabCache files the batch by."""
    row_lens = [sum(min(len(it["input_ids"]), max_len) for it in row) for row in rows]
    T = max(row_lens)
    T = -(-T // pad_to_multiple) * pad_to_multiple
    first = rows[0][0]
    n_aux, H = first["aux_hidden_states"].shape[1:]
    dtype = first["aux_hidden_states"].dtype
    # where the items are: host memory (a store), or the accelerator (an online colocated producer,
    # whose states never go through the host)
    dev = first["aux_hidden_states"].device
    at = dict(device=dev, pin_memory=pin and dev.type == "cpu")
    B = len(rows)
    out = {"input_ids": torch.zeros(B, T, dtype=torch.long, **at),
           "loss_mask": torch.zeros(B, T, dtype=torch.long, **at),
           "position_ids": torch.zeros(B, T, dtype=torch.long, **at),
           "doc_ids": torch.full((B, T), -1, dtype=torch.long, **at),
           "aux_hidden_states": torch.zeros(B, T, n_aux * H, dtype=dtype, **at),
           "last_hidden_state": torch.zeros(B, T, H, dtype=dtype, **at)}
    fp8 = "aux_scales" in first
    if fp8:
        out["aux_scales"] = torch.ones(B, T, n_aux, dtype=torch.float32, **at)
        out["last_scales"] = torch.ones(B, T, dtype=torch.float32, **at)
    docs = []
    for b, row in enumerate(rows):
        pos = 0
        docs.append([])
        for d, it in enumerate(row):
            n = min(len(it["input_ids"]), max_len - pos)
            if n <= 0:
                break
            if ids is not None:
                docs[-1].append((int(ids[b][d]), n))
            sl = slice(pos, pos + n)
            out["input_ids"][b, sl] = it["input_ids"][:n]
            out["loss_mask"][b, sl] = it["loss_mask"][:n].long()
            out["position_ids"][b, sl] = torch.arange(n, device=dev)
            out["doc_ids"][b, sl] = d
            out["aux_hidden_states"][b, sl] = it["aux_hidden_states"][:n].reshape(n, n_aux * H)
            out["last_hidden_state"][b, sl] = it["last_hidden_state"][:n]
            if fp8:
                out["aux_scales"][b, sl] = it["aux_scales"][:n]
                out["last_scales"][b, sl] = it["last_scales"][:n]
            pos += n
    out["num_tokens"] = torch.tensor(sum(row_lens), pin_memory=at["pin_memory"])  # on the host: no device wait
    if ids is not None:
        out["docs"] = tuple(tuple(r) for r in docs)
    return out


class MicroBatches(torch.utils.data.Dataset):
    """Item k = the collated k-th micro-batch of a list of micro-batches (rows of sample ids)."""

    def __init__(self, store: HiddenStateSource, micro_batches: List[List[List[int]]], max_len: int,
                 pad_to_multiple: int = 1, pin: bool = False, head_rows_steps: Optional[int] = None):
        self.store = store
        self.micro_batches = micro_batches
        self.max_len = max_len
        self.pad_to_multiple = pad_to_multiple
        self.pin = pin  # collate into pinned host memory (see collate)
        # TTT steps: a host batch also gets ``head_rows`` (eagle3.train.ttt.head_rows), the rows the
        # draft head then runs on (train.loss_rows_only); None, or a batch on the device: not added
        self.head_rows_steps = head_rows_steps

    def __len__(self):
        return len(self.micro_batches)

    def __getitem__(self, k):
        ids = self.micro_batches[k]
        rows = [[self.store[i] for i in row] for row in ids]
        batch = collate(rows, self.max_len, self.pad_to_multiple, self.pin, ids=ids)
        if self.head_rows_steps and batch["loss_mask"].device.type == "cpu":
            r = head_rows(batch["loss_mask"], batch["doc_ids"], self.head_rows_steps)
            if r is not None:  # None: every position has loss, nothing to leave out
                batch["head_rows"] = r.pin_memory() if self.pin else r
        return batch


def to_device(batch: dict, device) -> dict:
    """The batch's tensors on ``device`` (async from pinned memory); anything else as it is."""
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


class DeviceCopies:
    """Iterates ``batches`` (host batches, pinned) with each batch's tensors on the CUDA ``device``,
    copied on a side stream: :meth:`ahead`, called once a step's work is issued, starts the next
    step's copies, which then run on a copy engine beside that step's kernels. Copied in the
    compute stream's own order instead, the GPU waited for them (the 8B shape's 67 MB a step:
    ~1.2 ms on an H200). The compute stream waits for a batch's copy (an event) before its first
    use, and each tensor is marked as used there (``record_stream``), so that its memory is not
    reused before the step is done with it. Tensors already on the device (an online store's) pass
    through. An error reading a batch is raised by the ``next`` that would have returned it, never
    by :meth:`ahead` (called inside a step: the loop's state is whole between steps only)."""

    def __init__(self, batches, device):
        self._batches = iter(batches)
        self._device = torch.device(device)
        self._stream = torch.cuda.Stream(self._device)
        self._issued: collections.deque = collections.deque()
        self._ended = False
        self._error: Optional[BaseException] = None

    def ahead(self, n: int) -> None:
        """Start the copies of the next ``n`` batches (those not started yet)."""
        while len(self._issued) < n and not self._ended:
            try:
                batch = next(self._batches)
            except StopIteration:
                self._ended = True
                return
            except Exception as e:  # raised by __next__ once the batches before it are taken
                self._error, self._ended = e, True
                return
            with torch.cuda.stream(self._stream):
                batch = to_device(batch, self._device)
                done = torch.cuda.Event()
                done.record(self._stream)
            self._issued.append((batch, done))

    def __iter__(self):
        return self

    def __next__(self):
        self.ahead(1)
        if not self._issued:
            if self._error is not None:
                err, self._error = self._error, None
                raise err
            raise StopIteration
        batch, done = self._issued.popleft()
        compute = torch.cuda.current_stream(self._device)
        compute.wait_event(done)
        for v in batch.values():
            if isinstance(v, torch.Tensor) and v.device.type == "cuda":
                v.record_stream(compute)
        return batch


class Prefetcher:
    """Iterates ``batches`` (the loop's DataLoader) in a background thread, up to ``depth`` batches
    ahead, in the same order. With ``train.num_workers=0`` (the default, and what an online store
    needs) reading items, collating and pinning otherwise run on the thread that issues the GPU
    work: while they run the device idles. Here they overlap the device's work instead (file reads,
    copies and kernels release the GIL). An exception in the thread is raised by ``next``; ``close``
    stops the thread (also while it waits for room in the queue)."""

    _END = object()

    def __init__(self, batches, depth: int = 2, device=None):
        import queue
        import threading

        self._queue: "queue.Queue" = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._finished = False
        cuda = None  # the loop's CUDA device as an index: a new thread starts on device 0
        if device is not None and torch.device(device).type == "cuda":
            cuda = torch.device(device).index
            cuda = torch.cuda.current_device() if cuda is None else cuda
        self._thread = threading.Thread(target=self._run, args=(batches, cuda), daemon=True,
                                        name="eagle3-prefetch")
        self._thread.start()

    def _put(self, x) -> bool:
        import queue

        while not self._stop.is_set():
            try:
                self._queue.put(x, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, batches, cuda) -> None:
        try:
            if cuda is not None:
                torch.cuda.set_device(cuda)
            for b in batches:
                if not self._put((None, b)):
                    return
            self._put((None, self._END))
        except BaseException as e:  # raised again by __next__, on the loop's thread
            self._put((e, None))

    def __iter__(self):
        return self

    def __next__(self):
        if self._finished:
            raise StopIteration
        err, b = self._queue.get()
        if err is not None:
            self._finished = True
            raise err
        if b is self._END:
            self._finished = True
            raise StopIteration
        return b

    def close(self) -> None:
        import queue

        self._stop.set()
        while True:  # let a thread blocked on a full queue see the stop
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        # A thread inside a read (an online store waiting for a producer's shard) sees the stop only
        # after it: on an error path do not wait that long; the thread is a daemon.
        self._thread.join(timeout=60)
        if self._thread.is_alive():
            import logging

            logging.getLogger("eagle3.train").warning("the batch prefetch thread is still inside a read; "
                                                      "leaving it (a daemon thread) behind")
