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

from eagle3.stage import Inputs, Stage

log = logging.getLogger("eagle3.extract")


class Extract(Stage):
    name = "extract"

    def consume(self, cfg, manifest) -> Inputs:
        from eagle3.extract.checks import refuse_known_bad
        from eagle3.extract.layout import check_tokenizer
        from eagle3.extract.recording import prepared_splits
        from eagle3.target import resolve

        target = resolve(cfg.target, cfg.workspace)
        upstream = manifest.consume_upstream("extract", target.identity())
        prep = upstream["prepare"]
        check_tokenizer(prep, target)
        probe = None
        if cfg.extract.layer_ids == "auto":  # chosen by the layer probe (cached per target, data and settings)
            from eagle3.extract.layer_probe import choose_layer_ids

            probe = choose_layer_ids(manifest.exp_dir, target, prep, cfg.extract, target.run_dtype(cfg.target.dtype))
        splits, derived = prepared_splits(prep, cfg.extract, target, cfg.target.dtype,
                                          layer_ids=probe["layer_ids"] if probe else None)
        refuse_known_bad(target.config, cfg.extract.backend, tuple(derived.layout.layer_ids),
                         target_dtype=derived.target_dtype, target_path=target.path)  # before any engine or job exists
        return Inputs(cfg=cfg, manifest=manifest, target=target, upstream=upstream, prep=prep, splits=splits,
                      derived=derived, layer_probe=probe)

    def identity(self, inputs) -> dict:
        from eagle3.hashing import semantic_dict

        layout = inputs.derived.layout
        return {"extract": semantic_dict(inputs.cfg.extract), "layer_ids": list(layout.layer_ids),
                "last_layer_id": layout.last_layer_id, "store_dtype": layout.dtype,
                "target_dtype": inputs.derived.target_dtype}

    def claim(self, job, inputs):
        # a complete store counts only while every shard has its recorded sha256 tree (reads the store)
        return job.claim(digests=True, progress=inputs.cfg.progress)

    def before(self, job, inputs) -> None:
        from eagle3.extract.recording import discard_damaged

        if job.damaged:
            discard_damaged(job)
        layout = inputs.derived.layout
        log.info("extract: layer ids %s + last layer %d of a %d-layer target, hidden %d, %s store from a %s target",
                 tuple(layout.layer_ids), layout.last_layer_id, layout.last_layer_id, layout.hidden_size, layout.dtype,
                 inputs.derived.target_dtype)

    def execute(self, job, inputs):
        """One process, or the part p of N of a scale-out: the last part to finish records the run."""
        from eagle3.extract import EngineSpec, extract_store
        from eagle3.extract.checks import check_store
        from eagle3.extract.recording import extract_facts, record_outputs
        from eagle3.extract.reuse import extract_identity, fill_from_caches, reusable_caches

        cfg, extract_cfg, target, splits = inputs.cfg, inputs.cfg.extract, inputs.target, inputs.splits
        layout, target_dtype, prep = inputs.derived.layout, inputs.derived.target_dtype, inputs.prep
        reused = {}

        def extract(num_processes, process_index):
            # training samples kept by an online run's cache with these very states: taken, not recomputed
            caches = reusable_caches(inputs.manifest, prep.config_hash, *extract_identity(layout, target_dtype, extract_cfg))
            if caches and "train" in splits:
                n = fill_from_caches(job.out_dir, splits["train"], layout, extract_cfg.samples_per_shard, caches,
                                     num_processes=num_processes, process_index=process_index, progress=cfg.progress)
                if n:
                    reused.update(samples=n, caches=[str(c) for c in caches])
                    print(f"extract: {n} of {len(splits['train'])} training samples taken from the online cache "
                          f"({', '.join(map(str, caches))}), the target not run for them")
            return extract_store(job.out_dir, splits, EngineSpec.of(target, inputs.derived, extract_cfg),
                                 num_processes=num_processes, process_index=process_index, progress=cfg.progress)

        regen = prep.facts.regen or {}
        greedy = bool(prep.facts.regenerated) and float(regen.get("temperature", 0.0)) == 0.0

        def record(result):
            checks = check_store(job.out_dir, list(splits), layout, target.path, target.config, target_dtype,
                                 extract_cfg, greedy=greedy, prepare_run=prep.config_hash,
                                 trust_remote_code=target.trust_remote_code)
            record_outputs(job, splits)
            job.facts = extract_facts(inputs.derived, extract_cfg, splits, checks, reused, inputs.layer_probe)

        return job.run_parts(extract, record, part=extract_cfg.shard_index, parts=extract_cfg.num_shards)

    def report(self, record, inputs) -> None:
        from eagle3.extract.recording import print_summary

        log.info("extract: store complete at %s (%s)", record.out_dir,
                 ", ".join(f"{s}: {len(v)} samples" for s, v in inputs.splits.items()))
        print_summary(record, inputs.derived.layout, inputs.splits)


STAGE = Extract()
run = STAGE.run
