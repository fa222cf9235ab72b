"""Background shard writer: captured rows go straight to their place in a preallocated shard file.

Every sample's length is known before extraction (the prepare stage tokenized it), so a shard's
safetensors header and the byte offset of every row are known when the shard begins. Captured
chunks (a prefill chunk of one request, or one HF batch row) are written with ``pwrite`` to their
final offsets as they arrive, in any order; nothing is buffered per sample, so memory stays at a
few engine steps whatever the shard size.

Nothing of the store's work waits in the forward loop (GPU): :class:`HostStager` packs a step's
states on the compute stream and copies them to a ring of pinned host buffers on its own CUDA
stream; the writer thread waits for that copy and hands 16 MiB pieces to row threads (``pwrite``
releases the GIL), which also start the pieces' writeback to disk at once (``sync_file_range``),
so the disk works while the GPU computes instead of in one fsync per shard. A shard's digest is
its sha256 tree (eagle3.hashing.sha256_tree_file: sha256 over the sha256 of each 16 MiB leaf of
the file): each leaf is hashed from the page cache by a pool of hash threads as soon as all its
bytes are written, in any order and on several cores, so at the end of a shard only its last
leaves remain to hash and flush (a plain sha256 runs in file order on one core: the shard's
last-state rows, which follow all its aux rows, could only be hashed after the last forward).
Finishing (fsync, the last leaves, sidecar, rename) runs on a finisher thread while the next shard
is written. The guarantees are those of a writer that hashes the finished file: fsync before
rename, the sidecar's digest is the file's (a range written twice makes the shard hash its whole
file again), the same bytes whatever the order.

It runs wherever the states are: in the driver process (hf, vllm_connector backends) or inside
vLLM's rank-0 worker (vllm backend), so hidden states never travel through vLLM's RPC.

An fp8 store (``StoreLayout.dtype == "fp8"``) is quantised where the states are
(:func:`store_rows`, eagle3.fp8): on the GPU before the device-to-host copy when the stager packs
a step (half the bytes to copy and to write), else by the writer thread on the CPU. Both run the
same float32 arithmetic, so the bits do not depend on where it ran.
"""
from __future__ import annotations

import errno
import hashlib
import mmap
import os
import queue
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Protocol

import numpy as np

from ..atomic import atomic_write_json, fsync_dir
from ..hashing import TREE_CHUNK, sha256_tree_root
from ..store import (
    ROW_TENSORS,
    SAMPLE_CHECKSUMS,
    SAMPLE_TENSORS,
    ShardSpec,
    StoreLayout,
    StoreWriteError,
    sample_hasher,
    shard_header,
    sidecar_path,
)

_HASH_CHUNK = TREE_CHUNK  # the tree's leaf size (recorded in each sidecar as tree_chunk)
_HASH_POOL: Optional[tuple] = None  # (pid, executor)
_HASH_POOL_LOCK = threading.Lock()


def _hash_pool() -> ThreadPoolExecutor:
    """The process's hash threads (shared by every open shard; hashlib releases the GIL). A forked
    child (vLLM's workers) gets its own: the parent's threads do not exist there."""
    global _HASH_POOL
    with _HASH_POOL_LOCK:
        if _HASH_POOL is None or _HASH_POOL[0] != os.getpid():
            _HASH_POOL = (os.getpid(), ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 2)),
                                                          thread_name_prefix="eagle3-shard-hash"))
        return _HASH_POOL[1]


@dataclass
class CapturedBatch:
    """Hidden states of one forward pass and where its rows go.

    ``segments``: (shard key, sample j within the shard, position of the first row in the sample,
    row_start, row_end) into the batch. ``aux`` is a list of n_aux [N, H] tensors (stacked by the
    writer thread) or one [N, n_aux, H] tensor; ``last`` is [N, H]. ``ready`` (a CUDA event) is
    waited on before reading; ``release`` is called once the rows are written (returns buffers).
    ``aux_scales`` [N, n_aux] and ``last_scales`` [N] (float32): set when aux/last are already
    quantised to fp8 (:func:`store_rows`); None otherwise (the writer converts or quantises)."""

    segments: list
    aux: Any
    last: Any
    ready: Any = None
    release: Optional[Callable[[], None]] = None
    aux_scales: Any = None
    last_scales: Any = None


def store_rows(aux, last, layout: StoreLayout) -> tuple:
    """Captured states -> what the store keeps, on the states' device: (aux, last, aux_scales,
    last_scales), the states in the store dtype with scales None, or for an fp8 store the float8
    values and their float32 scales (eagle3.fp8.quantize)."""
    import torch

    if layout.is_fp8:
        from ..fp8 import quantize

        av, as_ = quantize(aux)
        lv, ls = quantize(last)
        return av, lv, as_, ls
    dtype = getattr(torch, layout.dtype)
    return aux.to(dtype), last.to(dtype), None, None


class _OpenShard:
    def __init__(self, split_dir: Path, spec: ShardSpec, layout: StoreLayout, stream_hash: bool = True,
                 on_cpu: Callable[[float], None] = lambda s: None):
        self.spec = spec
        self.final = split_dir / spec.name
        self.tmp = split_dir / f".{spec.name}.tmp{os.getpid()}"
        header, self.off = shard_header(spec, layout)
        self.size = self.off["__end__"]
        self.aux_row = layout.n_aux * layout.hidden_size * layout.itemsize
        self.last_row = layout.hidden_size * layout.itemsize
        self.fp8 = layout.is_fp8
        self.aux_scale_row, self.last_scale_row = 4 * layout.n_aux, 4
        self.written = np.zeros(spec.num_samples, dtype=np.int64)
        self.hash: Optional[_TreeHash] = None
        self.on_cpu = on_cpu
        _remove_stale_temps(split_dir, spec.name)
        self.fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o666)  # the umask applies, as to every file eagle3 writes
        try:
            self._start(header)
        except BaseException:
            self.discard()  # e.g. a full disk: no temp file stays behind
            raise
        if stream_hash:
            # Everything but the per-token rows is written: hashing can start.
            self.hash = _TreeHash(self.fd, self.size, _fixed_ranges(self.off), on_cpu)

    def _start(self, header: bytes) -> None:
        spec = self.spec
        try:
            # Reserve the whole shard now: a full disk fails here, before any compute is spent on it.
            os.posix_fallocate(self.fd, 0, self.size)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # filesystems without fallocate
                raise
            os.ftruncate(self.fd, self.size)
        _pwrite(self.fd, header, 0)
        ids = np.concatenate([np.asarray(x, dtype=np.int32) for x in spec.input_ids]) if spec.num_tokens else \
            np.zeros(0, np.int32)
        mask = np.concatenate([np.asarray(x, dtype=np.uint8) for x in spec.loss_mask]) if spec.num_tokens else \
            np.zeros(0, np.uint8)
        index = np.arange(spec.first, spec.first + spec.num_samples, dtype=np.int64)
        for name, arr in (("offsets", spec.offsets), ("sample_index", index), ("input_ids", ids), ("loss_mask", mask)):
            _pwrite(self.fd, np.ascontiguousarray(arr).tobytes(), self.off[name])

    def claim_rows(self, j: int, pos: int, n: int) -> tuple:
        """Coverage bookkeeping for rows [pos, pos + n) of sample j (called in submission order);
        returns the file offsets of their aux and last-state bytes (fp8: then of their scales)."""
        length = int(self.spec.lengths[j])
        if pos > self.written[j] or pos + n > length:
            raise StoreWriteError(f"capture error: sample {self.spec.first + j} got rows [{pos}, {pos + n}) but has "
                                  f"{length} tokens and {int(self.written[j])} written so far (a gap means tokens were "
                                  f"skipped, e.g. by prefix caching)")
        if pos < self.written[j] and self.hash is not None:
            self.hash.rewritten()  # rows computed again (e.g. a preempted request): hash the final file
        self.written[j] = max(self.written[j], pos + n)
        row0 = int(self.spec.offsets[j]) + pos
        offs = (self.off["aux_hidden_states"] + row0 * self.aux_row, self.off["last_hidden_state"] + row0 * self.last_row)
        if self.fp8:
            offs += (self.off["aux_scales"] + row0 * self.aux_scale_row,
                     self.off["last_scales"] + row0 * self.last_scale_row)
        return offs

    def rows_written(self, offset: int, nbytes: int) -> None:
        if self.hash is not None:
            self.hash.add(offset, offset + nbytes)

    def finish(self) -> dict:
        short = np.nonzero(self.written != self.spec.lengths)[0]
        if short.size:
            j = int(short[0])
            raise StoreWriteError(f"capture error: shard {self.spec.name} ended with sample {self.spec.first + j} "
                                  f"incomplete ({int(self.written[j])}/{int(self.spec.lengths[j])} tokens captured; "
                                  f"{short.size} samples incomplete)")
        os.fsync(self.fd)  # while the hash threads read the last leaves
        sums = self.sample_checksums()
        digest = self.hash.result() if self.hash is not None else _hash_file(self.fd, self.size, self.on_cpu)
        os.close(self.fd)
        self.fd = -1
        rec = {"file": self.spec.name, "first_sample": self.spec.first, "num_samples": self.spec.num_samples,
               "num_tokens": self.spec.num_tokens, "size": self.size, "sha256_tree": digest,
               "tree_chunk": _HASH_CHUNK, SAMPLE_CHECKSUMS: sums}
        # The sidecar goes first: a shard file that exists always has its record.
        atomic_write_json(sidecar_path(self.final.parent, self.spec.name), rec, indent=None)
        os.replace(self.tmp, self.final)
        fsync_dir(self.final.parent)
        return dict(rec, split=self.spec.split, k=self.spec.k)

    def sample_checksums(self) -> list:
        """Every sample's checksum (eagle3.store.sample_hasher) over the finished file's bytes, as a
        reader will read them (from the page cache: one more pass over the shard, ~16 GiB/s a core)."""
        t0 = time.thread_time()
        row = {"input_ids": 4, "loss_mask": 1, "aux_hidden_states": self.aux_row, "last_hidden_state": self.last_row,
               "aux_scales": self.aux_scale_row, "last_scales": self.last_scale_row}
        names = [n for n in SAMPLE_TENSORS if n in self.off]
        src = _FileBytes(self.fd, self.size)
        try:
            out = []
            for j in range(self.spec.num_samples):
                a, b = int(self.spec.offsets[j]), int(self.spec.offsets[j + 1])
                h = sample_hasher(a, b)
                for n in names:
                    src.update(h, self.off[n] + a * row[n], self.off[n] + b * row[n])
                out.append(h.hexdigest())
            return out
        finally:
            src.close()
            self.on_cpu(time.thread_time() - t0)

    def discard(self) -> None:
        if self.hash is not None:
            self.hash.cancel()  # before the fd is closed: the thread reads through it
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            self.tmp.unlink()
        except FileNotFoundError:
            pass


def _fixed_ranges(off: dict) -> list:
    """File ranges of a shard written when it is opened: the header and every tensor that is not
    per-token rows (ROW_TENSORS), from shard_header's start offsets (the tensors are contiguous)."""
    starts = sorted((o, name) for name, o in off.items() if name != "__end__")
    bounds = [o for o, _ in starts] + [off["__end__"]]
    ranges = [(0, bounds[0])]
    for (o, name), end in zip(starts, bounds[1:]):
        if name not in ROW_TENSORS:
            ranges.append((o, end))
    return ranges


def _read_into(fd: int, view: memoryview, offset: int) -> None:
    """Fill ``view`` from ``fd`` at ``offset`` (no new buffer per read)."""
    while len(view):
        n = os.preadv(fd, [view], offset)
        if n <= 0:
            raise OSError(errno.EIO, f"short read at offset {offset} while hashing a shard")
        view, offset = view[n:], offset + n


class _FileBytes:
    """Ranges of a file handed to sha256 without a copy: a read-only map of the file (the page
    cache itself, coherent with pwrite), or reads into a buffer where mapping fails."""

    def __init__(self, fd: int, size: int):
        self.fd = fd
        self._map = None
        try:
            self._map = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        except (OSError, ValueError, AttributeError):
            pass

    def update(self, h, a: int, b: int) -> None:
        """h.update(file[a:b]) in chunks (hashlib releases the GIL for each); several threads may
        read at once."""
        while a < b:
            n = min(_HASH_CHUNK, b - a)
            if self._map is not None:
                with memoryview(self._map) as whole, whole[a:a + n] as chunk:
                    h.update(chunk)
            else:
                chunk = memoryview(bytearray(n))
                _read_into(self.fd, chunk, a)
                h.update(chunk)
            a += n

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None


def _leaf(src: _FileBytes, size: int, c: int, on_cpu: Callable[[float], None]) -> bytes:
    t0 = time.thread_time()
    h = hashlib.sha256()
    a = c * _HASH_CHUNK
    src.update(h, a, min(size, a + _HASH_CHUNK))
    on_cpu(time.thread_time() - t0)
    return h.digest()


def _hash_file(fd: int, size: int, on_cpu: Callable[[float], None] = lambda s: None) -> str:
    """The sha256 tree of a written file (its leaves on the hash threads)."""
    src = _FileBytes(fd, size)
    try:
        leaves = [_hash_pool().submit(_leaf, src, size, c, on_cpu) for c in range(-(-size // _HASH_CHUNK))]
        return sha256_tree_root([f.result() for f in leaves])
    finally:
        src.close()


class _TreeHash:
    """The sha256 tree of a shard file while its ranges are written in any order.

    ``add(a, b)`` reports bytes [a, b) written; a leaf (``_HASH_CHUNK`` bytes of the file) goes to the
    hash threads once all its bytes are there. ``result()`` (after every byte is written) waits for
    the last leaves and returns the root. If a range is written twice (``rewritten()``), a leaf may
    have been hashed before its final bytes: the whole file is hashed again at the end."""

    def __init__(self, fd: int, size: int, written: list, on_cpu: Callable[[float], None]):
        self.fd, self.size = fd, size
        n = -(-size // _HASH_CHUNK)
        self._need = np.full(n, _HASH_CHUNK, dtype=np.int64)
        if n:
            self._need[-1] = size - (n - 1) * _HASH_CHUNK
        self._got = np.zeros(n, dtype=np.int64)
        self._leaves: dict = {}
        self._lock = threading.Lock()
        self._restart = False
        self._on_cpu = on_cpu
        self._src = _FileBytes(fd, size)
        for a, b in written:
            self.add(a, b)

    def add(self, a: int, b: int) -> None:
        with self._lock:
            c = a // _HASH_CHUNK
            while a < b:
                e = min(b, (c + 1) * _HASH_CHUNK)
                self._got[c] += e - a
                if self._got[c] == self._need[c] and not self._restart:
                    self._leaves[c] = _hash_pool().submit(_leaf, self._src, self.size, c, self._on_cpu)
                elif self._got[c] > self._need[c]:
                    self._restart = True
                a, c = e, c + 1

    def rewritten(self) -> None:
        with self._lock:
            self._restart = True

    def result(self) -> str:
        try:
            with self._lock:
                leaves, restart = dict(self._leaves), self._restart
            digests = [leaves[c].result() if c in leaves else None for c in range(len(self._need))]
            if restart or any(d is None for d in digests):
                return _hash_file(self.fd, self.size, self._on_cpu)
            return sha256_tree_root(digests)
        finally:
            self.cancel()

    def cancel(self) -> None:
        """Drop the leaves not started and wait for the running ones (they read through the file)."""
        with self._lock:
            leaves = list(self._leaves.values())
        for f in leaves:
            f.cancel()
        wait(leaves)
        self._src.close()


def _writeback_starter() -> Optional[Callable[[int, int, int], Any]]:
    """``sync_file_range(fd, offset, n, SYNC_FILE_RANGE_WRITE)`` (Linux): start writing a range to
    disk without waiting for it. Only a head start for the fsync that finishing still does."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return lambda fd, offset, n: fn(fd, offset, n, 2)  # 2 = SYNC_FILE_RANGE_WRITE; errors only lose the head start


_PIECE = 16 << 20


def _raw(t):
    """A CPU tensor's bytes as a flat uint8 array (no copy when it is contiguous)."""
    import torch

    t = t.contiguous()
    return t.view(torch.uint8).reshape(-1).numpy() if t.numel() else b""


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

    ``begin(spec)`` opens a shard, ``write(key, batch)`` queues rows, ``end(key)`` finalizes it
    (coverage check, fsync, sha256 tree, sidecar, rename) in a finisher thread, so that flushing and
    hashing one shard overlap writing the rows of the next. ``poll()`` returns finished shard records and
    raises :class:`StoreWriteError` if the thread failed; ``close()`` waits for everything.

    ``stream_hash`` (hash each shard while it is written) and ``early_writeback`` (start writing
    pieces to disk as they land in the page cache) change only when the work is done, never the
    bytes or the records: with both off, each shard is flushed and then read back to hash it."""

    def __init__(self, store_dir: str | Path, layout: StoreLayout, max_pending: int = 8, stream_hash: bool = True,
                 early_writeback: bool = True, row_threads: int = 4):
        self.store_dir = Path(store_dir)
        self.layout = layout
        self.stream_hash = stream_hash
        self._writeback = _writeback_starter() if early_writeback else None
        self._q: queue.Queue = queue.Queue(maxsize=max_pending)
        self._open: dict = {}
        self._done: list = []
        self._lock = threading.Lock()
        self._error: Optional[BaseException] = None
        self.cpu_seconds = 0.0  # CPU time of the writer threads (the benchmark accounts it)
        self._finisher = ThreadPoolExecutor(max_workers=2, thread_name_prefix="eagle3-shard-finisher")
        # Row copies into the page cache run on a few threads (pwrite releases the GIL): one thread
        # tops out well below a fast disk's bandwidth.
        self._rows = ThreadPoolExecutor(max_workers=max(1, min(row_threads, os.cpu_count() or 1)),
                                        thread_name_prefix="eagle3-rows")
        self._thread = threading.Thread(target=self._loop, name="eagle3-shard-writer", daemon=True)
        self._thread.start()

    # -- producer side ----------------------------------------------------------------------------
    def begin(self, spec: ShardSpec) -> None:
        (self.store_dir / spec.split).mkdir(parents=True, exist_ok=True)
        self._put(("begin", spec))

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

    def _pwrite_rows(self, shard: "_OpenShard", t, offset: int) -> None:
        t0 = time.thread_time()
        try:
            data = _raw(t)
            _pwrite(shard.fd, data, offset)
            if self._writeback is not None:
                self._writeback(shard.fd, offset, len(data))
            shard.rows_written(offset, len(data))
        finally:
            self._add_cpu(time.thread_time() - t0)

    def _handle(self, op: str, arg) -> None:
        if op == "begin":
            key = (arg.split, arg.k)
            self._open[key] = _OpenShard(self.store_dir / arg.split, arg, self.layout, self.stream_hash, self._add_cpu)
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
        aux = batch.aux if isinstance(batch.aux, torch.Tensor) else torch.stack(list(batch.aux), dim=1)
        last, aux_s, last_s = batch.last, batch.aux_scales, batch.last_scales
        if aux_s is None:  # not converted where the states were (CPU): here, the same arithmetic
            aux, last, aux_s, last_s = store_rows(aux, last, self.layout)
        elif not self.layout.is_fp8:
            raise StoreWriteError("capture error: fp8 scales sent to a store of dtype " + self.layout.dtype)
        aux, last = aux.contiguous(), last.contiguous()
        if aux_s is not None:
            from ..fp8 import bad_scales

            aux_s, last_s = aux_s.contiguous(), last_s.contiguous()
            if bad_scales(aux_s) or bad_scales(last_s):
                raise StoreWriteError(f"capture error: non-finite hidden states (fp8 scales of a batch for "
                                      f"{sorted({tuple(s[0]) for s in batch.segments})} are not finite): the target "
                                      f"produced inf/nan")
        jobs = []
        for key, j, pos, rs, re in batch.segments:
            shard = self._open.get(tuple(key))
            if shard is None:
                raise StoreWriteError(f"capture error: rows for shard {key} which is not open")
            offs = shard.claim_rows(j, pos, re - rs)
            aux_off, last_off = offs[:2]
            step = max(1, _PIECE // shard.aux_row)  # pieces of ~16 MiB spread over the row threads
            for a in range(rs, re, step):
                b = min(re, a + step)
                jobs.append((shard, aux[a:b], aux_off + (a - rs) * shard.aux_row))
                jobs.append((shard, last[a:b], last_off + (a - rs) * shard.last_row))
            if shard.fp8:
                jobs.append((shard, aux_s[rs:re], offs[2]))
                jobs.append((shard, last_s[rs:re], offs[3]))
        # Wait for all of this batch's rows before the next op: "end" then finds every row written,
        # the batch's buffers are released only after the copies, and after a failure no row thread
        # still writes through a file descriptor that is about to be closed.
        futures = [self._rows.submit(self._pwrite_rows, *job) for job in jobs]
        wait(futures)
        for f in futures:
            f.result()

    def _discard_all(self) -> None:
        for shard in self._open.values():
            shard.discard()
        self._open.clear()


class ShardSink(Protocol):
    """Where the shard loop sends a backend's output: :class:`ShardWriter`, or a proxy for one that
    runs elsewhere (the vllm backend's writer lives in vLLM's worker process)."""

    def begin(self, spec: ShardSpec) -> None: ...
    def write(self, batch: CapturedBatch) -> None: ...
    def end(self, key) -> None: ...
    def poll(self) -> list: ...
    def close(self) -> list: ...
    def abort(self) -> None: ...


def write_shards(sink: ShardSink, specs: Iterable[ShardSpec],
                 produce: Callable[[ShardSpec], Iterable[Optional[CapturedBatch]]], poll_every: float = 2.0) -> list:
    """The shard loop, once for every backend.

    For each spec (in order): ``sink.begin(spec)``; every item of ``produce(spec)`` is written (a
    :class:`CapturedBatch`) or skipped (``None``: the producer made progress whose rows it hands to
    the writer itself, e.g. inside vLLM's worker); the sink is polled at least every
    ``poll_every`` seconds so a writer failure stops the producer early; then ``sink.end(key)``.
    Shards are produced one after another: a shard's rows come only from its own samples, so its
    bytes do not depend on what else this run writes (resume and scale-out give the same files).
    Finally ``sink.close()`` waits for every shard. On any error the sink is aborted (open shards'
    temp files removed) and the error re-raised. Returns the finished shards' records."""
    done: list = []
    try:
        for spec in specs:
            sink.begin(spec)
            last_poll = time.perf_counter()
            for batch in produce(spec):
                if batch is not None:
                    sink.write(batch)
                if time.perf_counter() - last_poll > poll_every:
                    done += sink.poll()
                    last_poll = time.perf_counter()
            sink.end((spec.split, spec.k))
            done += sink.poll()
        done += sink.close()
    except BaseException:
        sink.abort()
        raise
    return done


class HostStager:
    """Device -> pinned host copies that the compute stream never waits for (CUDA); the writer
    thread waits on the returned event. On CPU the tensors pass through untouched.

    ``stage`` packs a step's states into one device buffer on the compute stream (a device copy:
    the sources may be overwritten by the next step, e.g. a CUDA graph's static outputs), then
    copies it to a pinned buffer on the stager's own stream, so the next forward pass runs while
    the copy engine moves the bytes. A ring of ``depth`` pinned buffers bounds host memory and
    gives backpressure when the disk is slower than the GPU; ``wait_seconds`` is how long the
    producer waited for a free buffer.

    Pinning host memory is slow (tens of ms for the 256 MiB an 8B target's 8k-token step takes), so
    a buffer is allocated at ``min_bytes`` at least (the largest step the engine can schedule) and
    the stager is meant to live as long as its engine: buffers are reused by every later capture,
    never re-pinned per step or per run. ``alloc_seconds`` is the time spent pinning."""

    def __init__(self, depth: int = 4, min_bytes: int = 0):
        self.depth = depth
        self.min_bytes = int(min_bytes)
        self._free: queue.Queue = queue.Queue()
        self._created = 0
        self._stream = None
        self.wait_seconds = 0.0
        self.alloc_seconds = 0.0

    def _pinned(self, nbytes: int):
        import torch

        t0 = time.perf_counter()
        buf = torch.empty(max(nbytes, self.min_bytes), dtype=torch.uint8, pin_memory=True)
        self.alloc_seconds += time.perf_counter() - t0
        return buf

    def _buffer(self, nbytes: int):
        if self._free.empty() and self._created < self.depth:
            self._created += 1
            return self._pinned(nbytes)
        t0 = time.perf_counter()
        buf = self._free.get()
        self.wait_seconds += time.perf_counter() - t0
        if buf.numel() < nbytes:
            buf = self._pinned(nbytes)
        return buf

    def stage(self, aux, last):
        """aux [N, n_aux, H], last [N, H] (any device) -> (aux_host, last_host, event, release)."""
        if not aux.is_cuda:
            return aux, last, None, None
        (aux_h, last_h), event, release = self._stage((aux, last))
        return aux_h, last_h, event, release

    def capture(self, segments: list, aux, last, layout: StoreLayout) -> CapturedBatch:
        """A step's states as the store keeps them (:func:`store_rows`: the store dtype, or fp8
        values + scales, computed on the states' device), staged to the host: the batch to write."""
        aux, last, aux_s, last_s = store_rows(aux, last, layout)
        if not aux.is_cuda:
            return CapturedBatch(segments, aux, last, aux_scales=aux_s, last_scales=last_s)
        tensors = (aux, last) if aux_s is None else (aux, last, aux_s, last_s)
        host, event, release = self._stage(tensors)
        return CapturedBatch(segments, host[0], host[1], event, release,
                             *(host[2:] if aux_s is not None else ()))

    def _stage(self, tensors: tuple) -> tuple:
        """CUDA tensors -> (their pinned host copies, event, release): one device pack on the
        compute stream, one copy on the stager's stream."""
        import torch

        device = tensors[0].device
        sizes = [t.numel() * t.element_size() for t in tensors]
        starts, pos = [], 0
        for n in sizes:
            starts.append(pos)
            pos += -(-n // 16) * 16  # every part 16-byte aligned (views of wider dtypes need it)
        buf = self._buffer(pos)
        compute = torch.cuda.current_stream(device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        packed = torch.empty(pos, dtype=torch.uint8, device=device)
        for t, a, n in zip(tensors, starts, sizes):
            packed[a:a + n].view(t.dtype).view(t.shape).copy_(t)
        self._stream.wait_stream(compute)
        with torch.cuda.stream(self._stream):
            buf[:pos].copy_(packed, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        packed.record_stream(self._stream)  # its memory is not reused before the copy has read it
        host = [buf[a:a + n].view(t.dtype).view(t.shape) for t, a, n in zip(tensors, starts, sizes)]
        return host, event, lambda: self._free.put(buf)


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
