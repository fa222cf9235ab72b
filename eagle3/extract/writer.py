"""Background shard writer: captured rows go straight to their place in a preallocated shard file.

Every sample's length is known before extraction (the prepare stage tokenized it), so a shard's
safetensors header and the byte offset of every row are known when the shard begins. Captured
chunks (a prefill chunk of one request, or one HF batch row) are written with ``pwrite`` to their
final offsets as they arrive, in any order; nothing is buffered per sample, so memory stays at a
few engine steps whatever the shard size. The writer runs in its own thread so that device->host
copies (on GPU), dtype conversion and disk writes overlap the next forward pass.

It runs wherever the states are: in the driver process (hf, vllm_connector backends) or inside
vLLM's rank-0 worker (vllm backend), so hidden states never travel through vLLM's RPC.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import queue
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Protocol

import numpy as np

from ..atomic import atomic_write_json, fsync_dir
from ..store import ShardPlan, StoreLayout, StoreWriteError, shard_header, sidecar_path

_HASH_CHUNK = 16 << 20


@dataclass
class CapturedBatch:
    """Hidden states of one forward pass and where its rows go.

    ``segments``: (shard key, sample j within the shard, position of the first row in the sample,
    row_start, row_end) into the batch. ``aux`` is a list of n_aux [N, H] tensors (stacked by the
    writer thread) or one [N, n_aux, H] tensor; ``last`` is [N, H]. ``ready`` (a CUDA event) is
    waited on before reading; ``release`` is called once the rows are written (returns buffers)."""

    segments: list
    aux: Any
    last: Any
    ready: Any = None
    release: Optional[Callable[[], None]] = None


class _OpenShard:
    def __init__(self, split_dir: Path, plan: ShardPlan, layout: StoreLayout):
        self.plan = plan
        self.final = split_dir / plan.name
        self.tmp = split_dir / f".{plan.name}.tmp{os.getpid()}"
        header, self.off = shard_header(plan, layout)
        self.size = self.off["__end__"]
        self.aux_row = layout.n_aux * layout.hidden_size * layout.itemsize
        self.last_row = layout.hidden_size * layout.itemsize
        self.written = np.zeros(plan.num_samples, dtype=np.int64)
        _remove_stale_temps(split_dir, plan.name)
        self.fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            # Reserve the whole shard now: a full disk fails here, before any compute is spent on it.
            os.posix_fallocate(self.fd, 0, self.size)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # filesystems without fallocate
                raise
            os.ftruncate(self.fd, self.size)
        _pwrite(self.fd, header, 0)
        ids = np.concatenate([np.asarray(x, dtype=np.int32) for x in plan.input_ids]) if plan.num_tokens else \
            np.zeros(0, np.int32)
        mask = np.concatenate([np.asarray(x, dtype=np.uint8) for x in plan.loss_mask]) if plan.num_tokens else \
            np.zeros(0, np.uint8)
        index = np.arange(plan.first, plan.first + plan.num_samples, dtype=np.int64)
        for name, arr in (("offsets", plan.offsets), ("sample_index", index), ("input_ids", ids), ("loss_mask", mask)):
            _pwrite(self.fd, np.ascontiguousarray(arr).tobytes(), self.off[name])

    def claim_rows(self, j: int, pos: int, n: int) -> tuple[int, int]:
        """Coverage bookkeeping for rows [pos, pos + n) of sample j (called in submission order);
        returns the file offsets of their aux and last-state bytes."""
        length = int(self.plan.lengths[j])
        if pos > self.written[j] or pos + n > length:
            raise StoreWriteError(f"capture error: sample {self.plan.first + j} got rows [{pos}, {pos + n}) but has "
                                  f"{length} tokens and {int(self.written[j])} written so far (a gap means tokens were "
                                  f"skipped, e.g. by prefix caching)")
        self.written[j] = max(self.written[j], pos + n)
        row0 = int(self.plan.offsets[j]) + pos
        return self.off["aux_hidden_states"] + row0 * self.aux_row, self.off["last_hidden_state"] + row0 * self.last_row

    def finish(self) -> dict:
        short = np.nonzero(self.written != self.plan.lengths)[0]
        if short.size:
            j = int(short[0])
            raise StoreWriteError(f"capture error: shard {self.plan.name} ended with sample {self.plan.first + j} "
                                  f"incomplete ({int(self.written[j])}/{int(self.plan.lengths[j])} tokens captured; "
                                  f"{short.size} samples incomplete)")
        os.fsync(self.fd)
        h = hashlib.sha256()
        pos = 0
        while pos < self.size:
            chunk = os.pread(self.fd, min(_HASH_CHUNK, self.size - pos), pos)
            h.update(chunk)
            pos += len(chunk)
        os.close(self.fd)
        self.fd = -1
        rec = {"file": self.plan.name, "first_sample": self.plan.first, "num_samples": self.plan.num_samples,
               "num_tokens": self.plan.num_tokens, "size": self.size, "sha256": h.hexdigest()}
        # The sidecar goes first: a shard file that exists always has its record.
        atomic_write_json(sidecar_path(self.final.parent, self.plan.name), rec, indent=None)
        os.replace(self.tmp, self.final)
        fsync_dir(self.final.parent)
        return dict(rec, split=self.plan.split, k=self.plan.k)

    def discard(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            self.tmp.unlink()
        except FileNotFoundError:
            pass


_PIECE = 16 << 20


def _raw(t):
    """A contiguous CPU tensor as a writable-free byte buffer (no copy)."""
    import torch

    t = t.contiguous()
    return t.view(torch.uint8).numpy() if t.numel() else b""


def _pwrite(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while len(view):
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _remove_stale_temps(split_dir: Path, name: str) -> None:
    """Temp files of this shard left by killed runs (their pid is gone) are removed."""
    for p in split_dir.glob(f".{name}.tmp*"):
        pid = p.name.rsplit(".tmp", 1)[-1]
        alive = False
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                os.kill(int(pid), 0)
                alive = True
            except (ProcessLookupError, PermissionError):
                alive = False
        if not alive:
            p.unlink(missing_ok=True)


class ShardWriter:
    """Writes shards from captured batches in a background thread.

    ``begin(plan)`` opens a shard, ``write(key, batch)`` queues rows, ``end(key)`` finalizes it
    (coverage check, fsync, sha256, sidecar, rename) in a second thread, so that hashing and
    flushing one shard overlap writing the rows of the next. ``poll()`` returns finished shard records and
    raises :class:`StoreWriteError` if the thread failed; ``close()`` waits for everything."""

    def __init__(self, store_dir: str | Path, layout: StoreLayout, max_pending: int = 4):
        self.store_dir = Path(store_dir)
        self.layout = layout
        self._q: queue.Queue = queue.Queue(maxsize=max_pending)
        self._open: dict = {}
        self._done: list = []
        self._lock = threading.Lock()
        self._error: Optional[BaseException] = None
        self.cpu_seconds = 0.0  # CPU time of the writer threads (the benchmark accounts it)
        self._finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eagle3-shard-finisher")
        # Row copies into the page cache run on a few threads (pwrite releases the GIL): one thread
        # tops out well below a fast disk's bandwidth.
        self._rows = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="eagle3-rows")
        self._thread = threading.Thread(target=self._loop, name="eagle3-shard-writer", daemon=True)
        self._thread.start()

    # -- producer side ----------------------------------------------------------------------------
    def begin(self, plan: ShardPlan) -> None:
        (self.store_dir / plan.split).mkdir(parents=True, exist_ok=True)
        self._put(("begin", plan))

    def write(self, batch: CapturedBatch) -> None:
        self._put(("write", batch))

    def end(self, key) -> None:
        self._put(("end", key))

    def poll(self) -> list:
        self._raise_if_failed()
        with self._lock:
            done, self._done = self._done, []
        return done

    def close(self) -> list:
        self._put(("stop", None))
        self._thread.join()
        self._rows.shutdown(wait=True)
        self._finisher.shutdown(wait=True)
        return self.poll()

    def abort(self) -> None:
        """Stop without finishing: open shards' temp files are removed (shards already being
        finished are completed: their rows are all written)."""
        if self._thread.is_alive():
            self._put(("abort", None))
            self._thread.join()
        self._rows.shutdown(wait=True)
        self._finisher.shutdown(wait=True)

    def _put(self, item) -> None:
        while True:
            self._raise_if_failed(item)
            try:
                self._q.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    def _raise_if_failed(self, item=None) -> None:
        if self._error is not None:
            if item is not None and item[0] == "write" and item[1].release:
                item[1].release()
            e = self._error
            if isinstance(e, StoreWriteError):
                raise StoreWriteError(str(e)) from e
            raise StoreWriteError(_describe(e, self.store_dir)) from e

    # -- writer thread ---------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            op, arg = self._q.get()
            if op in ("stop", "abort"):
                if op == "abort" or self._error is not None:
                    self._discard_all()
                return
            if self._error is not None:  # keep draining so producers never block on a dead writer
                if op == "write" and arg.release:
                    arg.release()
                continue
            t0 = time.thread_time()
            try:
                self._handle(op, arg)
            except BaseException as e:  # noqa: BLE001 - reported to the producer by poll()/close()
                self._error = e
                self._discard_all()
            self._add_cpu(time.thread_time() - t0)

    def _add_cpu(self, seconds: float) -> None:
        with self._lock:  # three kinds of threads add to it
            self.cpu_seconds += seconds

    def _pwrite_rows(self, fd: int, t, offset: int) -> None:
        t0 = time.thread_time()
        try:
            _pwrite(fd, _raw(t), offset)
        finally:
            self._add_cpu(time.thread_time() - t0)

    def _handle(self, op: str, arg) -> None:
        if op == "begin":
            key = (arg.split, arg.k)
            self._open[key] = _OpenShard(self.store_dir / arg.split, arg, self.layout)
        elif op == "write":
            try:
                self._write(arg)
            finally:
                if arg.release:
                    arg.release()
        elif op == "end":
            self._finisher.submit(self._finish, self._open.pop(tuple(arg)))

    def _finish(self, shard: "_OpenShard") -> None:
        t0 = time.thread_time()
        try:
            if self._error is not None:
                raise RuntimeError("writer failed")  # do not complete anything after a failure
            rec = shard.finish()
            with self._lock:
                self._done.append(rec)
        except BaseException as e:  # noqa: BLE001 - reported by poll()/close()
            shard.discard()
            if self._error is None:
                self._error = e
        finally:
            self._add_cpu(time.thread_time() - t0)

    def _write(self, batch: CapturedBatch) -> None:
        import torch

        if batch.ready is not None:
            batch.ready.synchronize()
        dtype = getattr(torch, self.layout.dtype)
        aux = batch.aux if isinstance(batch.aux, torch.Tensor) else torch.stack(list(batch.aux), dim=1)
        aux = aux.to(dtype).contiguous()
        last = batch.last.to(dtype).contiguous()
        jobs = []
        for key, j, pos, rs, re in batch.segments:
            shard = self._open.get(tuple(key))
            if shard is None:
                raise StoreWriteError(f"capture error: rows for shard {key} which is not open")
            aux_off, last_off = shard.claim_rows(j, pos, re - rs)
            step = max(1, _PIECE // shard.aux_row)  # pieces of ~16 MiB spread over the row threads
            for a in range(rs, re, step):
                b = min(re, a + step)
                jobs.append((shard.fd, aux[a:b], aux_off + (a - rs) * shard.aux_row))
                jobs.append((shard.fd, last[a:b], last_off + (a - rs) * shard.last_row))
        # Wait for this batch's rows before the next op: "end" then finds every row written, and
        # the batch's buffers are released only after the copies.
        for f in [self._rows.submit(self._pwrite_rows, *job) for job in jobs]:
            f.result()

    def _discard_all(self) -> None:
        for shard in self._open.values():
            shard.discard()
        self._open.clear()


class ShardSink(Protocol):
    """Where the shard loop sends a backend's output: :class:`ShardWriter`, or a proxy for one that
    runs elsewhere (the vllm backend's writer lives in vLLM's worker process)."""

    def begin(self, plan: ShardPlan) -> None: ...
    def write(self, batch: CapturedBatch) -> None: ...
    def end(self, key) -> None: ...
    def poll(self) -> list: ...
    def close(self) -> list: ...
    def abort(self) -> None: ...


def write_shards(sink: ShardSink, plans: Iterable[ShardPlan],
                 produce: Callable[[ShardPlan], Iterable[Optional[CapturedBatch]]], poll_every: float = 2.0) -> list:
    """The shard loop, once for every backend.

    For each plan (in order): ``sink.begin(plan)``; every item of ``produce(plan)`` is written (a
    :class:`CapturedBatch`) or skipped (``None``: the producer made progress whose rows it hands to
    the writer itself, e.g. inside vLLM's worker); the sink is polled at least every
    ``poll_every`` seconds so a writer failure stops the producer early; then ``sink.end(key)``.
    Shards are produced one after another: a shard's rows come only from its own samples, so its
    bytes do not depend on what else this run writes (resume and scale-out give the same files).
    Finally ``sink.close()`` waits for every shard. On any error the sink is aborted (open shards'
    temp files removed) and the error re-raised. Returns the finished shards' records."""
    done: list = []
    try:
        for plan in plans:
            sink.begin(plan)
            last_poll = time.perf_counter()
            for batch in produce(plan):
                if batch is not None:
                    sink.write(batch)
                if time.perf_counter() - last_poll > poll_every:
                    done += sink.poll()
                    last_poll = time.perf_counter()
            sink.end((plan.split, plan.k))
            done += sink.poll()
        done += sink.close()
    except BaseException:
        sink.abort()
        raise
    return done


class HostStager:
    """Device -> pinned host copies issued on the compute stream without waiting for them (CUDA); the
    writer thread waits on the event. A fixed pool of buffers bounds memory and gives backpressure
    when the disk is slower than the GPU. On CPU the tensors pass through untouched."""

    def __init__(self, depth: int = 3):
        self.depth = depth
        self._free: queue.Queue = queue.Queue()
        self._created = 0

    def _buffer(self, nbytes: int):
        import torch

        if self._free.empty() and self._created < self.depth:
            self._created += 1
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        buf = self._free.get()
        if buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return buf

    def stage(self, aux, last):
        """aux [N, n_aux, H], last [N, H] (any device) -> (aux_host, last_host, event, release)."""
        import torch

        if not aux.is_cuda:
            return aux, last, None, None
        na = aux.numel() * aux.element_size()
        nl = last.numel() * last.element_size()
        buf = self._buffer(na + nl)
        aux_h = buf[:na].view(aux.dtype).view(aux.shape)
        last_h = buf[na:na + nl].view(last.dtype).view(last.shape)
        aux_h.copy_(aux, non_blocking=True)
        last_h.copy_(last, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return aux_h, last_h, event, lambda: self._free.put(buf)


def _describe(e: BaseException, store_dir: Path) -> str:
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        try:
            free = shutil.disk_usage(store_dir).free
            free_s = f"{free / 2**30:.2f} GiB free"
        except OSError:
            free_s = "free space unknown"
        return (f"disk full while writing the hidden-state store {store_dir} ({free_s}). Free space or use a "
                f"workspace= on a larger disk, then run extract again: it resumes from the last complete shard. "
                f"({e})")
    return f"writing the hidden-state store {store_dir} failed: {type(e).__name__}: {e}"
