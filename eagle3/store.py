"""The hidden-state store: what the extract stage writes and the train stage reads.

Layout of a store directory (the extract run's out_dir)::

    store.json                       written last: layer ids, dtype, per-split shard list (+ sha256 tree)
    <split>/shard-00000-of-00012.safetensors
    <split>/shard-00000-of-00012.json   sidecar: the shard's size and sha256 tree (eagle3.hashing.sha256_tree_file,
                                        leaves of tree_chunk bytes) and each sample's checksum, written before the shard
    <split>/index.json               per-split: shards (their sidecars' records) and every sample's length (for batching)

Each shard holds a contiguous range of samples [first, first + n) of one split, concatenated along
the token axis, with ``offsets`` (n + 1) marking where each sample starts:

    offsets            int64 [n + 1]
    sample_index       int64 [n]           global index of each sample in its split
    input_ids          int32 [T]
    aux_hidden_states  dtype [T, n_aux, H]  layers ``layer_ids`` (ascending, vLLM's convention)
    last_hidden_state  dtype [T, H]         layer ``last_layer_id`` = L: the final pre-norm state
    loss_mask          uint8 [T]

A ``fp8`` store (format ``eagle3.hidden_states/2``, ``dtype`` "fp8"; eagle3.fp8 says how values
are quantised) holds the states as float8 e4m3 with one float32 scale per token and layer::

    offsets, sample_index, input_ids     as above
    aux_hidden_states  F8_E4M3 [T, n_aux, H]
    last_hidden_state  F8_E4M3 [T, H]
    scales_pad         uint8 [p]         only where the fp8 bytes end unaligned (p = -T*(n_aux+1)*H mod 4)
    aux_scales         float32 [T, n_aux]
    last_scales        float32 [T]
    loss_mask          uint8 [T]

Readers that know only format ``/1`` refuse such a store (its format string), so fp8 values are
never read as plain numbers; bf16/fp16/float32 stores keep format ``/1`` and the same bytes.

A shard's bytes depend only on its samples, the target and the layer ids/dtype (no timestamps, a
fixed header), so a resumed or scaled-out run writes the same files as one uninterrupted run.
Shards are written to a temp file, fsync'ed, then renamed: a shard file that exists is complete.

Each sample's checksum (``sample_xxh3_64`` in the sidecar and the index, one hex string a sample;
:func:`sample_checksum`) covers every byte a reader takes for it: its row range in the shard (so
the ``offsets`` that locate it) and its rows of ``input_ids``, ``loss_mask``, both state tensors
and, in an fp8 store, both scale tensors. :class:`HiddenStates` verifies it on every read of a
whole sample, so bytes that change after a shard was verified (the train stage verifies its
shards' digests once, before the first step, and then reads them memory-mapped) fail the read,
naming the shard and the sample. Stores written before the checksum have none (``checks_samples``
is false): read unchecked, as before.
"""
from __future__ import annotations

import bisect
import json
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from .artifacts import INDEX_JSON, STORE_JSON
from .atomic import atomic_write_json
from .errors import Eagle3Error
from .store_layout import _ST_DTYPES, FORMAT, FORMAT_FP8, FORMATS, StoreLayout  # noqa: F401 (the store's API)

# per-token tensors written as rows arrive (the rest of a shard is written when it is opened)
ROW_TENSORS = ("aux_hidden_states", "last_hidden_state", "aux_scales", "last_scales")
# what a sample's checksum covers, in this order (the scales only in an fp8 store)
SAMPLE_TENSORS = ("input_ids", "loss_mask", "aux_hidden_states", "last_hidden_state", "aux_scales", "last_scales")
SAMPLE_CHECKSUMS = "sample_xxh3_64"  # the sidecar's and the index's key: one checksum a sample (sample_checksum)
log = logging.getLogger("eagle3.store")


class StoreError(Eagle3Error):
    """A store is missing, incomplete, or was written for another target/config."""


REBUILD = ("`python -m eagle3 stage=extract` (with the overrides of the run that wrote the store) rebuilds "
           "it, and only what is damaged")
"""The way out of a damaged store, the same in every message: the extract stage finds missing,
truncated and corrupt shards (size and sha256 tree against the manifest) and writes them again."""


class StoreWriteError(Eagle3Error):
    """Writing a shard failed (e.g. the disk is full); no incomplete shard is left claiming completion."""


# -- shard planning -------------------------------------------------------------------------------

def shard_ranges(num_samples: int, samples_per_shard: int) -> list[tuple[int, int]]:
    """(first, count) of every shard of a split: contiguous, in sample order."""
    return [(a, min(samples_per_shard, num_samples - a)) for a in range(0, num_samples, samples_per_shard)]


def shard_name(k: int, num: int) -> str:
    return f"shard-{k:05d}-of-{num:05d}.safetensors"


def is_assigned(k: int, num_processes: int, process_index: int) -> bool:
    """Scale-out: process ``process_index`` of ``num_processes`` writes the shards k with
    k % num_processes == process_index. Whole shards (not samples) are dealt out, so every shard
    stays a contiguous sample range written by one process, and the store's bytes do not depend on
    how many processes wrote it."""
    return k % num_processes == process_index


@dataclass
class ShardSpec:
    """One shard to write: which samples, their tokens and loss masks."""

    split: str
    k: int
    num: int                  # number of shards in this split
    first: int                # global index of the first sample
    input_ids: list           # per sample: sequence of ints
    loss_mask: list           # per sample: sequence of 0/1
    lengths: np.ndarray = field(init=False)
    offsets: np.ndarray = field(init=False)

    def __post_init__(self):
        if len(self.input_ids) != len(self.loss_mask):
            raise ValueError("input_ids and loss_mask must have one entry per sample")
        self.lengths = np.array([len(x) for x in self.input_ids], dtype=np.int64)
        for i, (ids, m) in enumerate(zip(self.input_ids, self.loss_mask)):
            if len(ids) != len(m):
                raise ValueError(f"sample {self.first + i}: {len(ids)} input ids but {len(m)} loss-mask entries")
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)

    @property
    def name(self) -> str:
        return shard_name(self.k, self.num)

    @property
    def num_samples(self) -> int:
        return len(self.input_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])


def shard_header(spec: ShardSpec, layout: StoreLayout) -> tuple[bytes, dict]:
    """The safetensors header of a shard and each tensor's absolute byte offset in the file.

    Tensor order is fixed (8-byte types first, so every tensor is aligned to its item size)."""
    n, t = spec.num_samples, spec.num_tokens
    st_dtype = _ST_DTYPES[layout.dtype][0]
    specs = [("offsets", "I64", [n + 1], 8), ("sample_index", "I64", [n], 8), ("input_ids", "I32", [t], 4),
             ("aux_hidden_states", st_dtype, [t, layout.n_aux, layout.hidden_size], layout.itemsize),
             ("last_hidden_state", st_dtype, [t, layout.hidden_size], layout.itemsize)]
    if layout.is_fp8:
        # scales after the values (the stream hash follows the file's written prefix), 4-byte aligned
        pad = -(t * (layout.n_aux + 1) * layout.hidden_size) % 4
        specs += [("scales_pad", "U8", [pad], 1)] if pad else []
        specs += [("aux_scales", "F32", [t, layout.n_aux], 4), ("last_scales", "F32", [t], 4)]
    specs.append(("loss_mask", "U8", [t], 1))
    header, pos, rel = {}, 0, {}
    for name, dt, shape, size in specs:
        nbytes = int(np.prod(shape, dtype=np.int64)) * size
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [pos, pos + nbytes]}
        rel[name] = pos
        pos += nbytes
    meta = dict(layout.metadata(), split=spec.split, shard=str(spec.k), num_shards=str(spec.num),
                first_sample=str(spec.first), num_samples=str(n), num_tokens=str(t))
    header["__metadata__"] = meta
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + 8) % 8)  # pad so the data starts 8-byte aligned
    data_start = 8 + len(text)
    blob = len(text).to_bytes(8, "little") + text
    offsets = {name: data_start + p for name, p in rel.items()}
    offsets["__end__"] = data_start + pos
    return blob, offsets


# -- shard records (sidecars) ---------------------------------------------------------------------

def sidecar_path(split_dir: Path, name: str) -> Path:
    return split_dir / (name[: -len(".safetensors")] + ".json")


def read_shard_meta(path: Path) -> dict:
    """A shard's header metadata; StoreError naming the file where the header is not one."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        try:
            if n > os.fstat(f.fileno()).st_size - 8:
                raise ValueError(f"header length {n} beyond the end of the file")
            return json.loads(f.read(n)).get("__metadata__", {})
        except (ValueError, UnicodeDecodeError, AttributeError) as e:
            raise StoreError(f"shard {path} has a corrupt safetensors header ({e}); {REBUILD}") from None


def completed_shard(split_dir: Path, spec: ShardSpec, layout: StoreLayout) -> Optional[dict]:
    """The record of an already complete shard (for resume), None if it must be (re)written: also
    when it is damaged (a corrupt header, the wrong size, no sidecar), which is logged.

    Raises StoreError if a complete shard exists but was written for another target, layer ids or
    dtype: the directory is named by the config hash, so that means files were copied in by hand."""
    path = split_dir / spec.name
    side = sidecar_path(split_dir, spec.name)
    if not path.exists():
        return None
    _, offs = shard_header(spec, layout)
    try:
        meta = read_shard_meta(path)
    except StoreError as e:
        log.warning("extract: %s; writing it again", e)
        return None
    expected = dict(layout.metadata(), split=spec.split, shard=str(spec.k), num_shards=str(spec.num),
                    first_sample=str(spec.first), num_samples=str(spec.num_samples), num_tokens=str(spec.num_tokens))
    diff = {k: (meta.get(k), v) for k, v in expected.items() if meta.get(k) != v}
    if diff:
        raise StoreError(f"{path} exists but was written for another extraction ({diff}, as (found, expected)). "
                         f"Remove {split_dir.parent} (or that file) and run extract again.")
    if path.stat().st_size != offs["__end__"] or not side.exists():
        log.warning("extract: %s has %d bytes (a complete one has %d)%s: damaged, writing it again", path,
                    path.stat().st_size, offs["__end__"], "" if side.exists() else f" and no sidecar {side.name}")
        return None
    return json.loads(side.read_text())


def discard_damaged(store_dir: Path, names: list) -> list:
    """Remove damaged files of a store (``names``: paths relative to ``store_dir``) so that extraction
    writes them again: a shard goes with its sidecar (the record of its digest) and either with the
    other, and store.json (the mark of a complete store) goes whenever anything does; a split's
    index.json is written again by finalize_store. Returns the shard files removed."""
    store_dir = Path(store_dir)
    shards = set()
    for name in names:
        p = store_dir / name
        if p.name.startswith("shard-") and p.suffix in (".safetensors", ".json"):
            shards.add(p.with_suffix(".safetensors"))
        elif p.name in (INDEX_JSON, STORE_JSON):
            p.unlink(missing_ok=True)
    for shard in sorted(shards):
        shard.unlink(missing_ok=True)
        sidecar_path(shard.parent, shard.name).unlink(missing_ok=True)
    if names:
        (store_dir / STORE_JSON).unlink(missing_ok=True)
    return sorted(str(s.relative_to(store_dir)) for s in shards)


# -- finalizing -------------------------------------------------------------------------------------

def missing_shards(store_dir: Path, split_ranges: dict) -> list[str]:
    """Shard files (split/name) not yet present, given {split: [(first, count), ...]}."""
    out = []
    for split, ranges in split_ranges.items():
        for k in range(len(ranges)):
            name = shard_name(k, len(ranges))
            if not (store_dir / split / name).exists():
                out.append(f"{split}/{name}")
    return out


def finalize_store(store_dir: Path, layout: StoreLayout, split_lengths: dict, samples_per_shard: int) -> dict:
    """Write every split's index.json and then store.json, from the shards' sidecars.

    ``split_lengths``: {split: lengths of all its samples}. Every shard must be complete. Returns
    store.json's content. The output is a pure function of the shards (no timestamps), so any
    process of a scale-out run may finalize, and finalizing twice writes the same bytes."""
    store_dir = Path(store_dir)
    splits = {}
    for split, lengths in split_lengths.items():
        lengths = [int(x) for x in lengths]
        ranges = shard_ranges(len(lengths), samples_per_shard)
        missing = missing_shards(store_dir, {split: ranges})
        if missing:
            raise StoreError(f"cannot finalize {store_dir}: shards still missing: {missing[:5]}"
                             f"{' ...' if len(missing) > 5 else ''}")
        shards = []
        for k, (first, count) in enumerate(ranges):
            rec = json.loads(sidecar_path(store_dir / split, shard_name(k, len(ranges))).read_text())
            if rec["first_sample"] != first or rec["num_samples"] != count:
                raise StoreError(f"{split}/{rec['file']} covers samples {rec['first_sample']}+{rec['num_samples']}, "
                                 f"expected {first}+{count}; remove {store_dir} and extract again")
            shards.append(rec)
        index = {"format": layout.format, "split": split, "num_samples": len(lengths), "num_tokens": sum(lengths),
                 "samples_per_shard": samples_per_shard, "shards": shards, "lengths": lengths}
        (store_dir / split).mkdir(parents=True, exist_ok=True)
        atomic_write_json(store_dir / split / INDEX_JSON, index)
        splits[split] = {"num_samples": len(lengths), "num_tokens": sum(lengths), "num_shards": len(shards)}
    store = {"format": layout.format, **layout.to_json(), "bytes_per_token": layout.bytes_per_token,
             "samples_per_shard": samples_per_shard, "splits": splits}
    atomic_write_json(store_dir / STORE_JSON, store)
    return store


# -- per-sample checksums ----------------------------------------------------------------------------

def sample_hasher(a: int, b: int):
    """The hasher of the checksum of a sample at rows ``a:b`` of its shard, fed with those two bounds
    (int64): update it with the sample's rows of each tensor of SAMPLE_TENSORS the store has, in that
    order, and its ``hexdigest()`` is the checksum (eagle3.hashing.sample_hasher, xxh3_64). The writer
    computes it from the finished file, the reader from the rows it read (:func:`sample_checksum`)."""
    from .hashing import sample_hasher as hasher

    h = hasher()
    h.update(np.array([a, b], dtype=np.int64).tobytes())
    return h


def sample_checksum(a: int, b: int, parts) -> str:
    """The checksum of a sample at rows ``a:b`` whose rows are the buffers ``parts`` (:func:`sample_hasher`)."""
    h = sample_hasher(a, b)
    for part in parts:
        h.update(part)
    return h.hexdigest()


def _tensor_bytes(t):
    """A CPU tensor's bytes (no copy: the rows of a shard tensor are contiguous)."""
    import torch

    return t.contiguous().view(torch.uint8).numpy()


def check_sample(rows: dict, a: int, b: int, want: str, shard: Path, i: int) -> None:
    """``rows`` ({name: tensor} of sample ``i``'s rows ``a:b``, as read from ``shard``) have the checksum
    ``want`` recorded when the shard was written; a StoreError naming the shard and the sample if not."""
    got = sample_checksum(a, b, [_tensor_bytes(rows[n]) for n in SAMPLE_TENSORS if n in rows])
    if got != want:
        raise StoreError(f"shard {shard}: sample {i} (rows {a}:{b}) is not what extract wrote: its bytes as read "
                         f"have checksum {got}, the one recorded when the shard was written is {want}. The shard "
                         f"changed after it was written (if this process verified it first: while it was being "
                         f"read); {REBUILD}")


# -- reading ----------------------------------------------------------------------------------------

def checked_scales(scales, name: str, shard: Path, i: int):
    """fp8 scales of sample ``i`` read from ``shard``; a StoreError naming the shard if any is not finite
    and positive."""
    from .fp8 import bad_scales

    n = bad_scales(scales)
    if n:
        raise StoreError(f"fp8 shard {shard}: {n} of the {name} of sample {i} are not finite and positive; the "
                         f"shard is corrupt; {REBUILD}")
    return scales


def shard_item(tensor, a: int, b: int, i: int, is_fp8: bool, fp8: str, shard: Path,
               checksum: Optional[str] = None) -> dict:
    """Sample ``i`` (rows ``a:b`` of a shard) as a store item. ``tensor(name)`` gives the shard's tensor
    (or a safetensors slice) of that name; ``fp8``: ``dequantize`` or ``raw`` (values + scales).
    ``checksum``: the sample's recorded checksum, verified over the rows as read (:func:`check_sample`),
    before anything converts them."""
    import torch

    rows = {n: tensor(n)[a:b] for n in SAMPLE_TENSORS[:4] + (SAMPLE_TENSORS[4:] if is_fp8 else ())}
    if is_fp8:  # a bad scale is named as such, before the checksum would refuse it too
        aux_s = checked_scales(rows["aux_scales"], "aux_scales", shard, i)
        last_s = checked_scales(rows["last_scales"], "last_scales", shard, i)
    if checksum is not None:
        check_sample(rows, a, b, checksum, shard, i)
    item = {"input_ids": rows["input_ids"].to(torch.int64),
            "loss_mask": rows["loss_mask"].to(torch.bool),
            "aux_hidden_states": rows["aux_hidden_states"],
            "last_hidden_state": rows["last_hidden_state"],
            "sample_index": i}
    if is_fp8:
        if fp8 == "raw":
            item.update(aux_scales=aux_s, last_scales=last_s)
        else:
            from .fp8 import dequantize

            item["aux_hidden_states"] = dequantize(item["aux_hidden_states"], aux_s)
            item["last_hidden_state"] = dequantize(item["last_hidden_state"], last_s)
    return item



def one_sample_shard(split: str, i: int, num: int, ids, mask) -> ShardSpec:
    """Sample ``i`` of ``num`` alone in shard ``i`` (the online exchange's and cache's shards)."""
    return ShardSpec(split, i, num, i, [list(ids)], [list(mask)])


def read_shard_item(path: Path, layout: StoreLayout, fp8: str = "raw") -> dict:
    """A one-sample shard file of ``layout`` -> a store item (:func:`shard_item`, as HiddenStates
    gives it, scales checked), fully in memory (the file may be deleted right after)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:  # one copy out of the page cache per tensor
        t = {k: f.get_tensor(k) for k in f.keys()}
    missing = [n for n in ("aux_scales", "last_scales") if layout.is_fp8 and n not in t]
    if missing:
        raise StoreError(f"fp8 shard {path} has no {missing}: its values cannot be dequantised")
    return shard_item(t.__getitem__, 0, int(t["input_ids"].shape[0]), int(t["sample_index"][0]), layout.is_fp8,
                      fp8, path)

class HiddenStates(Sequence):
    """One split of a store as a sequence of samples; item i is a dict of CPU tensors:

    ``input_ids`` int64 [T], ``loss_mask`` bool [T], ``aux_hidden_states`` [T, n_aux, H],
    ``last_hidden_state`` [T, H] (store dtype), ``sample_index`` int.

    An fp8 store (``dtype`` "fp8") gives the states dequantised to float32 by default
    (``fp8="dequantize"``: value x scale, computed in float32, eagle3.fp8.dequantize). With
    ``fp8="raw"`` it gives the float8 e4m3 values as stored plus ``aux_scales`` float32 [T, n_aux]
    and ``last_scales`` float32 [T] (what the train stage uses: it dequantises on the device); a
    store of another dtype ignores the option. A scale that is missing, not finite or not positive
    raises StoreError naming the shard.

    Reads are lazy: each item reads only its own rows from the memory-mapped shard (safetensors
    ``safe_open``), so stores far larger than RAM work. Safe to use from DataLoader workers (each
    process opens its own file handles).

    Every item of a store with per-sample checksums (``checks_samples``) is verified as it is read
    (a StoreError naming the shard and the sample when its bytes are not those written);
    ``tokens`` and ``rows`` read parts of a sample and are not."""

    _MAX_OPEN = 32

    def __init__(self, store_dir: str | Path, split: str = "train", fp8: str = "dequantize"):
        if fp8 not in ("dequantize", "raw"):
            raise ValueError(f"fp8 must be 'dequantize' or 'raw', got {fp8!r}")
        self.fp8 = fp8
        self.store_dir = Path(store_dir)
        meta_path = self.store_dir / STORE_JSON
        if not meta_path.exists():
            raise StoreError(f"{self.store_dir} is not a complete hidden-state store (no {STORE_JSON}): the "
                             f"extraction has not finished. Run `python -m eagle3 stage=extract` (it resumes).")
        self.meta = json.loads(meta_path.read_text())
        fmt = self.meta.get("format")
        if fmt not in FORMATS:
            raise StoreError(f"{meta_path} has format {fmt!r}; this eagle3 reads {list(FORMATS)}")
        if (fmt == FORMAT_FP8) != (self.meta.get("dtype") == "fp8"):
            raise StoreError(f"{meta_path} has format {fmt!r} but dtype {self.meta.get('dtype')!r}: it was not "
                             f"written by eagle3; {REBUILD}")
        try:
            self.layout = StoreLayout.from_json(self.meta)  # what every shard of the store holds
        except (KeyError, TypeError, ValueError) as e:
            raise StoreError(f"{meta_path} holds no valid layout ({type(e).__name__}: {e}); {REBUILD}") from None
        if split not in self.meta["splits"]:
            raise StoreError(f"split {split!r} is not in {self.store_dir} (it has {sorted(self.meta['splits'])})")
        self.split = split
        self.index = json.loads((self.store_dir / split / INDEX_JSON).read_text())
        self.lengths = np.asarray(self.index["lengths"], dtype=np.int64)
        self._firsts = [s["first_sample"] for s in self.index["shards"]]
        for s in self.index["shards"]:
            p = self.store_dir / split / s["file"]
            if not p.exists() or p.stat().st_size != s["size"]:
                raise StoreError(f"{p} is missing or changed size since the store was written "
                                 f"(expected {s['size']} bytes); {REBUILD}")
        # each shard's per-sample checksums (None: a store written before them)
        self._checksums = [s.get(SAMPLE_CHECKSUMS) for s in self.index["shards"]]
        self._handles: OrderedDict = OrderedDict()
        self._offsets: dict = {}
        self._pid = os.getpid()

    # eagle3.train.source.HiddenStateSource: items are read into host memory, in any order
    on_device = False

    def expect(self, micro_batches) -> None:
        pass

    # the layout's figures, as eagle3.online.hidden_states.OnlineHiddenStates gives them
    layer_ids = property(lambda self: self.layout.layer_ids)
    last_layer_id = property(lambda self: self.layout.last_layer_id)
    hidden_size = property(lambda self: self.layout.hidden_size)
    dtype = property(lambda self: self.layout.dtype)
    is_fp8 = property(lambda self: self.layout.is_fp8)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def checks_samples(self) -> bool:
        """Whether every sample has a recorded checksum, verified as it is read (a store written
        before per-sample checksums has none)."""
        return all(c is not None for c in self._checksums)

    def __len__(self) -> int:
        return len(self.lengths)

    def _handle(self, k: int):
        from safetensors import safe_open

        if self._pid != os.getpid():  # forked into a DataLoader worker: do not share file handles
            self._handles.clear()
            self._pid = os.getpid()
        h = self._handles.get(k)
        if h is None:
            path = self.store_dir / self.split / self.index["shards"][k]["file"]
            try:
                h = safe_open(str(path), framework="pt")
            except Exception as e:  # safetensors' SafetensorError names no file
                raise StoreError(f"shard {path} cannot be read: {type(e).__name__}: {e} (a corrupt header?); "
                                 f"{REBUILD}") from None
            self._check_shard(path, h)
            self._handles[k] = h
            if len(self._handles) > self._MAX_OPEN:
                self._handles.popitem(last=False)
        else:
            self._handles.move_to_end(k)
        if k not in self._offsets:
            self._offsets[k] = h.get_tensor("offsets").numpy()
        return h

    def _check_shard(self, path: Path, h) -> None:
        """The shard holds what store.json says (format, dtype; an fp8 shard its scales)."""
        meta = h.metadata() or {}
        if meta.get("format") != self.layout.format or meta.get("dtype") != self.dtype:
            raise StoreError(f"shard {path} has format {meta.get('format')!r}, dtype {meta.get('dtype')!r} but the "
                             f"store is {self.layout.format!r}, {self.dtype!r}: it was not written by this "
                             f"extraction; {REBUILD}")
        if self.is_fp8:
            missing = [n for n in ("aux_scales", "last_scales") if n not in h.keys()]
            if missing:
                raise StoreError(f"fp8 shard {path} has no {missing}: its values cannot be dequantised; "
                                 f"{REBUILD}")

    def _shard_path(self, k: int) -> Path:
        return self.store_dir / self.split / self.index["shards"][k]["file"]

    def _scales(self, h, name: str, a: int, b: int, k: int, i: int):
        return checked_scales(h.get_slice(name)[a:b], name, self._shard_path(k), i)

    def _locate(self, i) -> tuple:
        """(open shard, its index k, first row, end row) of sample ``i``."""
        i = int(i)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples")
        k = bisect.bisect_right(self._firsts, i) - 1
        h = self._handle(k)
        off = self._offsets[k]
        j = i - self._firsts[k]
        return h, k, int(off[j]), int(off[j + 1])

    def tokens(self, i):
        """(input_ids int64 [T], loss_mask bool [T]) of sample ``i``, without reading its hidden states."""
        import torch

        h, _, a, b = self._locate(i)
        return h.get_slice("input_ids")[a:b].to(torch.int64), h.get_slice("loss_mask")[a:b].to(torch.bool)

    def rows(self, i, name: str, positions):
        """The rows of tensor ``name`` (``last_hidden_state`` or ``aux_hidden_states``) at token
        ``positions`` of sample ``i``, stacked: one small read per position, not the whole sample.
        An fp8 store's rows come dequantised (float32), as ``self[i]`` gives them by default."""
        import torch

        h, k, a, b = self._locate(i)
        sl = h.get_slice(name)
        out = []
        for t in positions:
            t = int(t)
            if not 0 <= t < b - a:
                raise IndexError(f"position {t} out of range for sample {i} of {b - a} tokens")
            row = sl[a + t:a + t + 1]
            if self.is_fp8:
                from .fp8 import dequantize

                scale_name = {"aux_hidden_states": "aux_scales", "last_hidden_state": "last_scales"}[name]
                row = dequantize(row, self._scales(h, scale_name, a + t, a + t + 1, k, i))
            out.append(row)
        return torch.cat(out) if out else sl[a:a]

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        h, k, a, b = self._locate(i)
        i = int(i) + (len(self) if int(i) < 0 else 0)
        sums = self._checksums[k]
        return shard_item(h.get_slice, a, b, i, self.is_fp8, self.fp8, self._shard_path(k),
                          checksum=None if sums is None else sums[i - self._firsts[k]])

    def __repr__(self) -> str:
        return (f"HiddenStates({self.store_dir}, split={self.split!r}, samples={len(self)}, tokens={self.num_tokens}, "
                f"layer_ids={self.layer_ids}, last_layer_id={self.last_layer_id}, dtype={self.dtype})")


def resolve_store_dir(path: str | Path) -> Path:
    """A store directory, an extract run's out_dir, or an experiment directory (through its manifest)."""
    p = Path(path).expanduser().resolve()
    if (p / STORE_JSON).exists():
        return p
    from .manifest import MANIFEST_NAME, Manifest

    if (p / MANIFEST_NAME).exists():
        rec = Manifest(p).current("extract")
        if rec is None:
            raise StoreError(f"experiment {p} has no extract run yet: run `python -m eagle3 stage=extract`")
        if rec.status != "complete":
            raise StoreError(f"the current extract run of {p} ({rec.config_hash[:12]}) is {rec.status}: "
                             f"run `python -m eagle3 stage=extract` again to finish it (it resumes)")
        return rec.out_dir
    if any(p.glob("*/shard-*")):
        return p  # an unfinished store: HiddenStates says so
    raise StoreError(f"{p} is neither a hidden-state store (no {STORE_JSON}) nor an experiment directory "
                     f"(no {MANIFEST_NAME})")


def open_hidden_states(path: str | Path, split: str = "train", fp8: str = "dequantize") -> HiddenStates:
    """The hidden states of ``split`` in a store, an extract run dir or an experiment dir. An fp8
    store's states come dequantised to float32 (``fp8="raw"``: values + scales; see HiddenStates)."""
    return HiddenStates(resolve_store_dir(path), split, fp8=fp8)
