"""The extract stage's bookkeeping around ``extract_store`` (the stage: stages/extract.py): the
prepared splits it reads, a damaged complete store discarded shard by shard, the store's outputs
and facts for the manifest, and the lines it prints at the end."""
from __future__ import annotations

import json


def prepared_splits(prep, extract_cfg, target, target_dtype: str, layer_ids=None) -> tuple:
    """(the splits to extract {name: DatasetSamples}, their ExtractLayout) of the prepare run
    ``prep``: refuses a split extract.splits names that is not there, a sample longer than the
    target's context (eagle3.extract.layout.derive_store_layout)."""
    from . import prepared_samples
    from .layout import derive_store_layout

    prepared = prepared_samples(prep)
    derived = derive_store_layout(extract_cfg, target, target_dtype, {s: v.lengths for s, v in prepared.items()},
                                  layer_ids=layer_ids)
    return {s: prepared[s] for s in derived.splits}, derived


def record_outputs(job, splits) -> None:
    """Every shard (with the digest its writer computed), its sidecar, each split's index and store.json."""
    from ..artifacts import INDEX_JSON, STORE_JSON

    out = job.out_dir
    for split in splits:
        index = json.loads((out / split / INDEX_JSON).read_text())
        for shard in index["shards"]:
            # the writer's digest: a sha256 tree (a store written before it became one: plain sha256)
            job.add_output(out / split / shard["file"], sha256=shard.get("sha256"),
                           sha256_tree=shard.get("sha256_tree"))
            job.add_output(out / split / (shard["file"][: -len(".safetensors")] + ".json"))
        job.add_output(out / split / INDEX_JSON)
    job.add_output(out / STORE_JSON)


def discard_damaged(job) -> None:
    """Remove what of a complete store is no longer as recorded (missing, truncated, corrupt): the
    extraction writes just those shards again and the run is recorded again."""
    from ..store import discard_damaged as discard

    prefix = job.rel_out + "/"
    names = [d.rel[len(prefix):] for d in job.damaged if d.rel.startswith(prefix)]
    shards = discard(job.out_dir, names)
    print(f"extract: the complete store {job.out_dir} is damaged ({'; '.join(str(d) for d in job.damaged[:3])}"
          f"{' ...' if len(job.damaged) > 3 else ''}): writing {len(shards)} shard(s) again: "
          f"{', '.join(shards[:5])}{' ...' if len(shards) > 5 else ''}")


def extract_facts(derived, extract_cfg, splits, checks: tuple, reused: dict, layer_probe=None):
    """:class:`eagle3.contracts.ExtractFacts` of a complete store; ``checks`` = (agreement, threshold,
    parity) of eagle3.extract.checks.check_store."""
    from ..contracts import ExtractFacts

    agreement, threshold, parity = checks
    layout = derived.layout
    return ExtractFacts(layout=layout, target_dtype=derived.target_dtype, backend=extract_cfg.backend,
                        num_samples={s: len(v) for s, v in splits.items()},
                        num_tokens={s: int(v.lengths.sum()) for s, v in splits.items()},
                        agreement=agreement, agreement_threshold=threshold, parity=parity,
                        reused=dict(reused) or None, layer_probe=layer_probe)


def print_summary(rec, layout, splits) -> None:
    """Bytes per token, the store's size on disk, what a data set of this size needs; the checks."""
    from ..units import fmt_size

    out_dir = rec.out_dir
    tokens = sum(int(v.lengths.sum()) for v in splits.values())
    size = sum(f.stat().st_size for f in out_dir.rglob("*") if f.is_file())
    print(f"extract: {layout.dtype} store, {layout.bytes_per_token} bytes/token "
          f"((n_aux+1) x H = {layout.n_aux + 1} x {layout.hidden_size}); {tokens} tokens, {fmt_size(size)} on disk "
          f"at {out_dir} (a data set of N tokens needs about N x {layout.bytes_per_token} B: "
          f"{fmt_size(1e9 * layout.bytes_per_token)} per billion tokens)")
    print(f"extract: {rec.facts.checks_line()}")
    if rec.facts.layer_probe:  # extract.layer_ids=auto
        from ..contracts import layer_probe_line

        print(f"extract: {layer_probe_line(rec.facts.layer_probe)}")
