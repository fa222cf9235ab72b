"""Extraction: run the target over token sequences and write the hidden-state store.

``extract_store`` is the whole job without the manifest (the stage, tests, the benchmark and
notebooks call it): it writes every shard assigned to this process that is not complete yet
(resume = skip complete shards), and finalizes the store (index + store.json) once every shard of
every split exists, whichever process wrote them.

Backends (``extract.backend``, registered in ``backend.BACKENDS``, all implementing
``backend.Extractor``): ``vllm`` (default; vllm_backend + vllm_worker), ``vllm_connector`` (vLLM's
extract_hidden_states + hidden-states connector), ``hf`` (transformers reference). Each supplies
what a shard's samples produce; the shard loop is ``writer.write_shards``. The checks of a finished
store (target agreement, the parity sample) and the refusals before an engine starts are in
``checks``; the training samples an online run's cache already holds are copied, not computed, by
``reuse``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from ..store import ShardSpec, completed_shard, finalize_store, is_assigned, missing_shards, shard_ranges
from .backend import BACKENDS, EngineSpec, Extractor, Progress, backend_class, make_extractor
from .layers import LayerIdError, default_layer_ids, resolve_layer_ids, resolve_store_dtype

log = logging.getLogger("eagle3.extract")

__all__ = ["Samples", "DatasetSamples", "prepared_samples", "extract_store", "EngineSpec", "make_extractor", "resolve_layer_ids",
           "default_layer_ids", "resolve_store_dtype", "LayerIdError", "ExtractResult", "Extractor", "Progress",
           "BACKENDS", "backend_class"]


class Samples:
    """Token sequences (and loss masks) of one split, in memory."""

    def __init__(self, input_ids: list, loss_mask: Optional[list] = None):
        self.input_ids = input_ids
        self.loss_mask = loss_mask if loss_mask is not None else [[1] * len(x) for x in input_ids]
        if len(self.loss_mask) != len(self.input_ids):
            raise ValueError("input_ids and loss_mask must have the same number of samples")
        self.lengths = np.array([len(x) for x in input_ids], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.input_ids)

    def get(self, a: int, b: int) -> tuple[list, list]:
        return self.input_ids[a:b], self.loss_mask[a:b]


class DatasetSamples:
    """One split of the prepare stage's dataset (``datasets``; columns input_ids, loss_mask), read
    one shard range at a time."""

    def __init__(self, ds):
        self.ds = ds
        if ds._indices is None:  # plain arrow table (as load_from_disk gives): lengths without decoding rows
            import pyarrow.compute as pc

            self.lengths = np.asarray(pc.list_value_length(ds.data.column("input_ids")).to_numpy(), dtype=np.int64)
        else:
            self.lengths = np.array([len(x) for x in ds["input_ids"]], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.ds)

    def get(self, a: int, b: int) -> tuple[list, list]:
        rows = self.ds[a:b]
        return rows["input_ids"], rows["loss_mask"]


def prepared_samples(prep) -> dict:
    """{split: DatasetSamples} of the prepare run ``prep``'s dataset: what the extract stage, online
    training and ``stage=plan`` read of it."""
    import datasets

    from ..artifacts import DATASET_DIR

    ds = datasets.load_from_disk(str(prep.path(DATASET_DIR)))
    return {s: DatasetSamples(ds[s]) for s in ds}


@dataclass
class ExtractResult:
    complete: bool            # every shard of every split exists and the store is finalized
    written: list             # records of shards written by this call
    store: Optional[dict]     # store.json content when complete
    missing: list             # shards still missing (written by other processes, or later)
    tokens: int               # tokens extracted by this call
    seconds: float
    stats: Optional[dict] = None  # backend's accounting (CPU seconds of capture / writer), if any


def extract_store(store_dir, splits: dict, engine: EngineSpec, *, num_processes: int = 1, process_index: int = 0,
                  progress: bool = True, extractor=None) -> ExtractResult:
    """Write the shards of ``splits`` ({name: Samples}) assigned to this process, in the layout
    ``engine.layout``; finalize if all exist.

    ``engine``: what builds the backend when there is work (closed afterwards); ``extractor``: an
    already built one to reuse instead (the benchmark does)."""
    import time

    store_dir = Path(store_dir)
    store_dir.mkdir(parents=True, exist_ok=True)
    layout, backend, sps = engine.layout, engine.backend, engine.extract_cfg.samples_per_shard
    todo: list[tuple] = []
    for split, samples in splits.items():
        ranges = shard_ranges(len(samples), sps)
        for k, (first, count) in enumerate(ranges):
            if not is_assigned(k, num_processes, process_index):
                continue
            probe = ShardSpec(split, k, len(ranges), first, [range(int(n)) for n in samples.lengths[first:first + count]],
                              [range(int(n)) for n in samples.lengths[first:first + count]])
            if completed_shard(store_dir / split, probe, layout) is None:
                todo.append((split, k, len(ranges), first, count))
    total = sum(int(splits[s].lengths[f:f + c].sum()) for s, _, _, f, c in todo)
    t0 = time.perf_counter()
    written: list = []
    stats = None
    if todo:
        skipped = sum(len(shard_ranges(len(s), sps)) for s in splits.values()) - len(todo)
        log.info("extract: %d shards (%d tokens) to write with backend %s%s", len(todo), total, backend,
                 f"; {skipped} complete or assigned to other processes" if skipped else "")

        def specs():
            for split, k, num, first, count in todo:
                ids, mask = splits[split].get(first, first + count)
                yield ShardSpec(split, k, num, first, list(ids), list(mask))

        own = extractor is None
        if own:
            extractor = make_extractor(engine, store_dir)
        bar = Progress(total, f"extract ({backend})", progress)
        try:
            written = extractor.run(specs(), store_dir, bar)
            stats = getattr(extractor, "last_stats", None)
        finally:
            bar.close()
            if own:
                extractor.close()
    seconds = time.perf_counter() - t0
    if todo:
        log.info("extract: wrote %d shards, %d tokens in %.1f s (%.0f tokens/s)", len(written), total, seconds,
                 total / seconds if seconds > 0 else float("nan"))
    missing = missing_shards(store_dir, {s: shard_ranges(len(v), sps) for s, v in splits.items()})
    store = None
    if not missing:
        store = finalize_store(store_dir, layout, {s: v.lengths for s, v in splits.items()}, sps)
    return ExtractResult(complete=not missing, written=written, store=store, missing=missing, tokens=total,
                         seconds=seconds, stats=stats)
