"""The extract stage's reuse of online caches: training samples whose hidden states an online train
run of this experiment kept (``train.online.cache_bytes``) are copied into the store, not computed.

A cache holds one sample per shard, each computed alone (one sample per forward, no padding), so its
bits are those extraction with ``extract.batch_size=1`` computes. A cache is taken only when the
train run recorded the very states this extract run computes (:func:`extract_identity`: target,
layer ids, dtypes, backend and its settings) from the same prepare run (:func:`reusable_caches`);
:func:`fill_from_caches` writes the store's shards from it, through the store's own writer.

This module reads what the online train runs recorded (their facts, the cache's shard files in the
store's format); it imports no online code.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from ..store import (
    ShardSpec,
    StoreError,
    StoreLayout,
    completed_shard,
    is_assigned,
    one_sample_shard,
    read_shard_item,
    shard_name,
    shard_ranges,
)


def extract_identity(layout: StoreLayout, target_dtype: str, extract_cfg) -> tuple:
    """(identity, extract settings) of the states a producer or an extract run with these settings
    computes: what an online run records as its producer and a cache must match to be reused."""
    from ..hashing import semantic_dict

    identity = {**layout.to_json(), "target_dtype": target_dtype, "backend": extract_cfg.backend}
    extract = {k: v for k, v in semantic_dict(extract_cfg).items() if k not in ("samples_per_shard", "splits")}
    return identity, extract


def reusable_caches(manifest, prepare_hash: str, identity: dict, extract: dict) -> list:
    """Split directories (``.../train``) of the caches kept by this experiment's online train runs
    whose states are the ones an extract run of ``identity`` / ``extract`` computes from the prepare
    run ``prepare_hash`` (same target, layer ids, dtypes, backend and backend settings)."""
    out = []
    runs = manifest.read()["stages"].get("train", {}).get("runs", {})
    for _, run in sorted(runs.items()):
        f, up = run.get("facts") or {}, run.get("upstream") or {}
        p = f.get("producer") or {}
        if f.get("hidden_states") != "online" or not f.get("cache_dir") or up.get("prepare") != prepare_hash:
            continue
        if {k: p.get(k) for k in identity} != identity or p.get("extract") != extract:
            continue
        d = Path(f["cache_dir"])
        out += [x for x in [d / "train", *sorted(d.glob("rank-*/train"))] if x.is_dir() and x not in out]
    return out


def fill_from_caches(store_dir: Path, samples, layout: StoreLayout, samples_per_shard: int, caches: list, *,
                     num_processes: int = 1, process_index: int = 0, progress: bool = True) -> int:
    """Write the training split's shards (this process's, ``samples_per_shard`` samples each) whose
    every sample one of ``caches`` holds, from the cached states instead of running the target: the
    same bits (a cached sample was computed alone, as extraction with ``extract.batch_size=1``
    computes it), in the store's format through its writer (atomic, digests). Shards already
    complete are left alone. Returns the number of samples taken from the caches."""
    from .backend import Progress
    from .writer import CapturedBatch, ShardWriter

    store_dir = Path(store_dir)
    N = len(samples)

    def cached(i: int) -> Optional[Path]:
        return next((c / shard_name(i, N) for c in caches if (c / shard_name(i, N)).exists()), None)

    todo = []
    ranges = shard_ranges(N, samples_per_shard)
    for k, (first, count) in enumerate(ranges):
        if not caches or not is_assigned(k, num_processes, process_index):
            continue
        paths = [cached(i) for i in range(first, first + count)]
        if any(p is None for p in paths):
            continue
        ids, mask = samples.get(first, first + count)
        shard = ShardSpec("train", k, len(ranges), first, list(ids), list(mask))
        if completed_shard(store_dir / "train", shard, layout) is None:
            todo.append((shard, paths))
    if not todo:
        return 0
    (store_dir / "train").mkdir(parents=True, exist_ok=True)
    bar = Progress(sum(shard.num_tokens for shard, _ in todo), "extract (from the online cache)", progress)
    w = ShardWriter(store_dir, layout)
    try:
        for shard, paths in todo:
            w.begin(shard)
            for j, path in enumerate(paths):
                i = shard.first + j
                completed_shard(path.parent, one_sample_shard("train", i, N, shard.input_ids[j], shard.loss_mask[j]),
                                layout)  # refuses a shard written for another layout
                item = read_shard_item(path, layout)
                if item["input_ids"].tolist() != list(shard.input_ids[j]):
                    raise StoreError(f"{path} holds other tokens than training sample {i} of the prepared dataset; "
                                     f"remove that cache directory ({path.parent.parent}) or re-run the online run")
                n = len(shard.input_ids[j])
                w.write(CapturedBatch([(("train", shard.k), j, 0, 0, n)], item["aux_hidden_states"],
                                      item["last_hidden_state"], aux_scales=item.get("aux_scales"),
                                      last_scales=item.get("last_scales")))
                bar.update(n)
            w.end(("train", shard.k))
            w.poll()
        w.close()
    except BaseException:
        w.abort()
        raise
    finally:
        bar.close()
    return sum(shard.num_samples for shard, _ in todo)
