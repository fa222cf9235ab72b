"""Stage 2, extract: run the target over every prepared sample and store the aux hidden states of
``layer_ids`` and the final pre-norm state (id L) per token, as a sharded safetensors store.

Scale-out (``extract.num_shards=N extract.shard_index=p``, e.g. one SLURM array task each through
Hydra's submitit launcher): every process computes the same config hash, hence the same output
directory, and writes the shards k with k % N == p. Shard files are atomic and their bytes do not
depend on which process wrote them, so the parts need no coordination: each process, when done,
checks whether every shard of every split exists; the one that finds the store complete finalizes
it (index + store.json) and records the run in the manifest, under a lock. Until then the manifest
has no complete extract run, so train cannot consume a partial store. A process that died is
simply re-run (same p, or any N: complete shards are skipped). ``num_shards`` is not part of the
config hash for that reason. For example, four SLURM tasks:

    python -m eagle3 -m stage=extract extract.num_shards=4 extract.shard_index=0,1,2,3 \
        hydra/launcher=submitit_slurm

Checks (eagle3/extract/checks.py), in this order: refuse a known-bad engine/target combination
before any engine or job exists; extract; check the finished store (target agreement, and the
parity sample against transformers where the target fits); record. A failed check fails the run
(nothing is marked complete) with a message naming the figure, the threshold, the likely causes and
the override; the figures of a passing store are facts (``ExtractFacts.agreement``, ``parity``),
printed at the end and shown by ``stage=status``.
"""
from __future__ import annotations

import json
import logging

log = logging.getLogger("eagle3.extract")


def _record_outputs(job, splits) -> None:
    from eagle3.artifacts import INDEX_JSON, STORE_JSON

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


def _discard_damaged(job) -> None:
    """Remove what of a complete store is no longer as recorded (missing, truncated, corrupt): the
    extraction below writes just those shards again and the run is recorded again."""
    from eagle3.store import discard_damaged

    prefix = job.rel_out + "/"
    names = [d.rel[len(prefix):] for d in job.damaged if d.rel.startswith(prefix)]
    shards = discard_damaged(job.out_dir, names)
    print(f"extract: the complete store {job.out_dir} is damaged ({'; '.join(str(d) for d in job.damaged[:3])}"
          f"{' ...' if len(job.damaged) > 3 else ''}): writing {len(shards)} shard(s) again: "
          f"{', '.join(shards[:5])}{' ...' if len(shards) > 5 else ''}")


def _print_size(out_dir, layout, splits) -> None:
    """Bytes per token, the store's size on disk, and what a data set of this size needs."""
    from eagle3.report import fmt_size

    tokens = sum(int(v.lengths.sum()) for v in splits.values())
    size = sum(f.stat().st_size for f in out_dir.rglob("*") if f.is_file())
    print(f"extract: {layout.dtype} store, {layout.bytes_per_token} bytes/token "
          f"((n_aux+1) x H = {layout.n_aux + 1} x {layout.hidden_size}); {tokens} tokens, {fmt_size(size)} on disk "
          f"at {out_dir} (a data set of N tokens needs about N x {layout.bytes_per_token} B: "
          f"{fmt_size(1e9 * layout.bytes_per_token)} per billion tokens)")


def run(cfg, manifest):
    from filelock import FileLock, Timeout

    from eagle3.artifacts import DATASET_DIR
    from eagle3.contracts import ExtractFacts
    from eagle3.extract import DatasetSamples, extract_store
    from eagle3.extract.checks import check_store, refuse_known_bad
    from eagle3.extract.layout import check_tokenizer, derive_store_layout
    from eagle3.extract.reuse import extract_identity, fill_from_caches, reusable_caches
    from eagle3.hashing import semantic_dict
    from eagle3.manifest import ManifestError
    from eagle3.target import resolve

    ecfg = cfg.extract
    target = resolve(cfg.target, cfg.workspace)
    inputs = manifest.consume_upstream("extract", target.identity())
    prep = inputs["prepare"]
    check_tokenizer(prep, target)
    import datasets

    ds = datasets.load_from_disk(str(prep.path(DATASET_DIR)))
    prepared = {s: DatasetSamples(ds[s]) for s in ds}
    # refuses a split extract.splits names that is not there, a sample longer than the target's context
    derived = derive_store_layout(ecfg, target, cfg.target.dtype, {s: v.lengths for s, v in prepared.items()})
    splits = {s: prepared[s] for s in derived.splits}
    layout, layer_ids, target_dtype, store_dtype = (derived.layout, derived.layer_ids, derived.target_dtype,
                                                    derived.store_dtype)
    L, H = layout.last_layer_id, layout.hidden_size
    refuse_known_bad(target.config, ecfg.backend, layer_ids)  # before any engine or job exists
    config = {"extract": semantic_dict(ecfg), "layer_ids": list(layer_ids), "last_layer_id": L,
              "store_dtype": store_dtype, "target_dtype": target_dtype}
    job = manifest.start("extract", config=config, target=target.identity(), inputs=inputs)
    # a complete store counts only while every shard has its recorded sha256 tree (reads the store)
    if (done := job.claim(digests=True, progress=cfg.progress)) is not None:
        print(f"extract: already complete ({job.config_hash[:12]}, every shard's digest verified), nothing to do")
        return done
    if job.damaged:
        _discard_damaged(job)
    log.info("extract: layer ids %s + last layer %d of a %d-layer target, hidden %d, %s store from a %s target",
             layer_ids, L, L, H, store_dtype, target_dtype)

    reused = {}

    def extract(num_processes=1, process_index=0):
        # training samples kept by an online run's cache with these very states: taken, not recomputed
        caches = reusable_caches(manifest, prep.config_hash, *extract_identity(layout, target_dtype, ecfg))
        if caches and "train" in splits:
            n = fill_from_caches(job.out_dir, splits["train"], layout, ecfg.samples_per_shard, caches,
                                 num_processes=num_processes, process_index=process_index, progress=cfg.progress)
            if n:
                reused.update(samples=n, caches=[str(c) for c in caches])
                print(f"extract: {n} of {len(splits['train'])} training samples taken from the online cache "
                      f"({', '.join(map(str, caches))}), the target not run for them")
        return extract_store(job.out_dir, splits, layout, backend=ecfg.backend, target_path=target.path,
                             target_dtype=target_dtype, extract_cfg=ecfg, num_processes=num_processes,
                             process_index=process_index, progress=cfg.progress)

    regen = prep.facts.regen or {}
    greedy = bool(prep.facts.regenerated) and float(regen.get("temperature", 0.0)) == 0.0

    def record(result):
        agreement, threshold, parity = check_store(job.out_dir, list(splits), layout, target.path, target.config,
                                                   target_dtype, ecfg, greedy=greedy, prepare_run=prep.config_hash)
        _record_outputs(job, splits)
        job.facts = ExtractFacts(layer_ids=list(layer_ids), last_layer_id=L, hidden_size=H, store_dtype=store_dtype,
                                 target_dtype=target_dtype, backend=ecfg.backend, store_format=layout.format,
                                 bytes_per_token=layout.bytes_per_token,
                                 num_samples={s: len(v) for s, v in splits.items()},
                                 num_tokens={s: int(v.lengths.sum()) for s, v in splits.items()},
                                 agreement=agreement, agreement_threshold=threshold, parity=parity,
                                 reused=dict(reused) or None)

    if ecfg.num_shards == 1:
        with job:
            result = extract()
            if not result.complete:  # cannot happen with one process; a bug if it does
                raise RuntimeError(f"extract finished with shards missing: {result.missing[:5]}")
            record(result)
        log.info("extract: store complete at %s (%s)", job.out_dir,
                 ", ".join(f"{s}: {len(v)} samples" for s, v in splits.items()))
        _print_size(job.out_dir, layout, splits)
        print(f"extract: {job.record.facts.checks_line()}")
        return job.record

    p, n = ecfg.shard_index, ecfg.num_shards
    job.out_dir.mkdir(parents=True, exist_ok=True)
    try:
        with FileLock(str(job.out_dir / f".part-{p}-of-{n}.lock"), timeout=0):
            result = extract(n, p)
    except Timeout:
        raise ManifestError(f"another process is already extracting part {p} of {n} into {job.out_dir}") from None
    if not result.complete:
        log.info("extract: part %d of %d done; %d shards still missing (other parts), e.g. %s. The last part to "
                 "finish records the run in the manifest.", p, n, len(result.missing), result.missing[:3])
        print(f"extract: part {p}/{n} done; waiting for {len(result.missing)} shards from other parts")
        return None
    with FileLock(str(job.out_dir / ".finalize.lock")):
        if (done := job.claim()) is not None:  # another part finished at the same time and recorded the run
            return done
        with job:
            record(result)
    log.info("extract: part %d of %d completed the store at %s", p, n, job.out_dir)
    _print_size(job.out_dir, layout, splits)
    print(f"extract: {job.record.facts.checks_line()}")
    return job.record
