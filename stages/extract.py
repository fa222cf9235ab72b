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
printed at the end and shown by ``stage=status``. The scale-out's part locks and finalising:
``StageJob.run_parts``; the stage's bookkeeping (splits read, outputs, facts, summary):
eagle3/extract/recording.py.
"""
from __future__ import annotations

import logging

log = logging.getLogger("eagle3.extract")


def run(cfg, manifest):
    from eagle3.extract import extract_store
    from eagle3.extract.checks import check_store, refuse_known_bad
    from eagle3.extract.layout import check_tokenizer
    from eagle3.extract.recording import discard_damaged, extract_facts, prepared_splits, print_summary, record_outputs
    from eagle3.extract.reuse import extract_identity, fill_from_caches, reusable_caches
    from eagle3.hashing import semantic_dict
    from eagle3.target import resolve

    extract_cfg = cfg.extract
    target = resolve(cfg.target, cfg.workspace)
    inputs = manifest.consume_upstream("extract", target.identity())
    prep = inputs["prepare"]
    check_tokenizer(prep, target)
    splits, derived = prepared_splits(prep, extract_cfg, target, cfg.target.dtype)
    layout, layer_ids, target_dtype = derived.layout, derived.layer_ids, derived.target_dtype
    refuse_known_bad(target.config, extract_cfg.backend, layer_ids, target_dtype=target_dtype,
                     target_path=target.path)  # before any engine or job exists
    config = {"extract": semantic_dict(extract_cfg), "layer_ids": list(layer_ids), "last_layer_id": derived.last_layer_id,
              "store_dtype": derived.store_dtype, "target_dtype": target_dtype}
    job = manifest.start("extract", config=config, target=target.identity(), inputs=inputs)
    # a complete store counts only while every shard has its recorded sha256 tree (reads the store)
    if (done := job.claim(digests=True, progress=cfg.progress)) is not None:
        return done
    if job.damaged:
        discard_damaged(job)
    log.info("extract: layer ids %s + last layer %d of a %d-layer target, hidden %d, %s store from a %s target",
             layer_ids, derived.last_layer_id, derived.last_layer_id, derived.hidden_size, derived.store_dtype,
             target_dtype)
    reused = {}

    def extract(num_processes, process_index):
        # training samples kept by an online run's cache with these very states: taken, not recomputed
        caches = reusable_caches(manifest, prep.config_hash, *extract_identity(layout, target_dtype, extract_cfg))
        if caches and "train" in splits:
            n = fill_from_caches(job.out_dir, splits["train"], layout, extract_cfg.samples_per_shard, caches,
                                 num_processes=num_processes, process_index=process_index, progress=cfg.progress)
            if n:
                reused.update(samples=n, caches=[str(c) for c in caches])
                print(f"extract: {n} of {len(splits['train'])} training samples taken from the online cache "
                      f"({', '.join(map(str, caches))}), the target not run for them")
        return extract_store(job.out_dir, splits, layout, backend=extract_cfg.backend, target_path=target.path,
                             target_dtype=target_dtype, extract_cfg=extract_cfg, num_processes=num_processes,
                             process_index=process_index, progress=cfg.progress,
                             trust_remote_code=target.trust_remote_code)

    regen = prep.facts.regen or {}
    greedy = bool(prep.facts.regenerated) and float(regen.get("temperature", 0.0)) == 0.0

    def record(result):
        checks = check_store(job.out_dir, list(splits), layout, target.path, target.config, target_dtype, extract_cfg,
                             greedy=greedy, prepare_run=prep.config_hash, trust_remote_code=target.trust_remote_code)
        record_outputs(job, splits)
        job.facts = extract_facts(derived, extract_cfg, splits, checks, reused)

    # one process, or the part p of N of a scale-out (the last part to finish records the run)
    rec = job.run_parts(extract, record, part=extract_cfg.shard_index, parts=extract_cfg.num_shards)
    if rec is not None:
        log.info("extract: store complete at %s (%s)", rec.out_dir,
                 ", ".join(f"{s}: {len(v)} samples" for s, v in splits.items()))
        print_summary(rec, layout, splits)
    return rec
