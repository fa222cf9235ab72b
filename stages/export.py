"""Stage 4, export: the trained draft (or one trained elsewhere, ``export.from=DIR``) -> a directory
vLLM (or SGLang) serves, verified in the real vLLM: it loads, it is lossless, its acceptance
length agrees with the offline evaluator's for the trained draft, and it is compared with prompt
lookup. The export lives in the experiment (``export/<hash>/model``, recorded with its facts in the
manifest); ``export.out_dir`` additionally receives a copy, never over another model unless
``export.overwrite=true``.
"""
from __future__ import annotations

import json
import logging
import os

log = logging.getLogger("eagle3.export")


def run(cfg, manifest):
    from eagle3.artifacts import MODEL_DIR
    from eagle3.contracts import ExportFacts
    from eagle3.export.outdir import precheck_destination, publish, refuse_inputs
    from eagle3.export.sources import check_embedding, load_source
    from eagle3.hashing import semantic_dict
    from eagle3.target import resolve

    ecfg = cfg.export
    target = resolve(cfg.target, cfg.workspace)
    if ecfg.out_dir:  # never over what this run reads, whatever export.overwrite says
        refuse_inputs(ecfg.out_dir, run_inputs(cfg, target.path, manifest.exp_dir))
    ckpt, inputs, prep, from_id = load_source(cfg, manifest, target, needs_prompts=ecfg.verify)
    check_embedding(ckpt, target, ecfg.include_embedding)
    dtype = target.run_dtype(cfg.target.dtype)
    from eagle3.export.prompts import prompts_identity

    config = {"export": export_semantics(ecfg, semantic_dict), "dtype": dtype, "from_identity": from_id,
              "prompts_identity": prompts_identity(ecfg)}
    job = manifest.start("export", config=config, target=target.identity(), inputs=inputs)
    if (done := job.claim()) is not None:
        print(f"export: already complete ({job.config_hash[:12]}): {done.out_dir / MODEL_DIR}")
        if ecfg.out_dir:
            action = publish(done.out_dir / MODEL_DIR, ecfg.out_dir, ecfg.overwrite)
            print(f"export: {ecfg.out_dir}: {'already up to date' if action == 'same' else 'copied'}")
        return done
    if ecfg.out_dir:  # refuse a taken destination before spending minutes on verification
        precheck_destination(ecfg.out_dir, ecfg.overwrite)
    if ecfg.verify:  # a KV cache that cannot fit, named by its eagle3 key, before any engine starts
        from eagle3.kv_cache import check_fits, weights_bytes

        draft_bytes = sum(t.numel() * t.element_size() for t in ckpt.tensors.values())
        check_fits("export.kv_cache_gb", ecfg.kv_cache_gb, weights_bytes(target.path) + draft_bytes)

    import shutil

    with job:
        final_dir = job.out_dir / MODEL_DIR
        if final_dir.exists():  # a failed earlier attempt of this same config (before partial exports)
            shutil.rmtree(final_dir)
        # everything is written and verified in a hidden sibling, renamed to model/ once it passed:
        # a failed export leaves no complete-looking model/ behind
        model_dir = job.out_dir / f".{MODEL_DIR}.partial"
        if model_dir.exists():
            shutil.rmtree(model_dir)
        try:
            facts = _write_and_verify(cfg, manifest, job, target, ckpt, inputs, prep, dtype, model_dir, final_dir)
        except BaseException:
            shutil.rmtree(model_dir, ignore_errors=True)
            raise
        os.replace(model_dir, final_dir)
        if ecfg.out_dir:
            publish(final_dir, ecfg.out_dir, ecfg.overwrite)
            facts["exported_to"] = str(ecfg.out_dir)
        job.add_output(final_dir)
        job.facts = ExportFacts(**facts)
    _print_summary(job.record)
    return job.record


def run_inputs(cfg, target_path, exp_dir) -> dict:
    """{what: path} of everything an export run reads, which export.out_dir must stay clear of."""
    out = {"the target": target_path, "the experiment directory (every stage's artifacts and the manifest)": exp_dir}
    if cfg.target.gguf:
        out["the target's GGUF file"] = cfg.target.gguf
    paths = [cfg.data.path] + [s.path for s in cfg.data.sources]
    for i, p in enumerate(x for x in paths if x and not str(x).startswith("builtin")):
        out[f"the data file {i + 1}"] = p
    if cfg.export.prompts:
        out["the prompts file (export.prompts)"] = cfg.export.prompts
    if cfg.export.from_:
        out["the draft to export (export.from)"] = cfg.export.from_
    return out


def _write_and_verify(cfg, manifest, job, target, ckpt, inputs, prep, dtype, model_dir, final_dir) -> dict:
    """The export written into ``model_dir`` and verified there; returns the facts to record (which
    name ``final_dir``, where it will be)."""
    from eagle3.artifacts import EXPORT_MARKER as MARKER
    from eagle3.export.formats import ExportSpec, write_format
    from eagle3.export.model_card import model_card
    from eagle3.export.outdir import fingerprint

    ecfg = cfg.export
    spec = ExportSpec(target_path=str(target.path), target_config=target.config, dtype=dtype,
                      num_speculative_tokens=ecfg.num_speculative_tokens,
                      include_embedding=ecfg.include_embedding)
    written = write_format(ckpt, ecfg.format, model_dir, spec)
    c = ckpt.config
    marker = {"format": ecfg.format, "fingerprint": fingerprint(model_dir), "target": target.identity(),
              "layer_ids": list(c.aux_layer_ids),
              "layer_id_convention": "sglang" if ecfg.format == "sglang" else "vllm",
              "draft_vocab_size": c.draft_vocab_size, "vocab_size": c.vocab_size, "dtype": dtype,
              "source": ckpt.source, "export_run": job.config_hash[:12]}
    (model_dir / MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
    facts = {"format": ecfg.format, "layer_ids": list(c.aux_layer_ids), "draft_vocab_size": c.draft_vocab_size,
             "vocab_size": c.vocab_size, "dtype": dtype, "fingerprint": marker["fingerprint"],
             "model_dir": str(final_dir.relative_to(manifest.exp_dir)), "source": ckpt.source}
    if ecfg.verify:
        from eagle3.export.prompts import held_out_prompts, stop_token_ids
        from eagle3.export.verify import verify_export
        from eagle3.kv_cache import translate

        categories: list = []
        prompts = held_out_prompts(ecfg, prep, target.path, categories=categories)
        try:
            facts.update(verify_export(
                model_dir, target_path=target.path, target_config=target.config, target_dtype=dtype,
                reference=ckpt, prompts=prompts, k=ecfg.num_speculative_tokens, eval_ks=ecfg.eval_ks,
                max_tokens=ecfg.eval_max_tokens, stop_ids=stop_token_ids(target.path),
                kv_cache_gb=ecfg.kv_cache_gb, gpu_memory_utilization=ecfg.gpu_memory_utilization,
                tolerance=ecfg.verify_tolerance, device=ecfg.device,
                progress=cfg.progress, categories=categories, temperatures=ecfg.eval_temperatures,
                seed=ecfg.eval_seed, tie_margin=ecfg.tie_margin))
        except Exception as e:  # vLLM's "KV cache does not fit" names its own flags: name ours
            if (named := translate(e, "export.kv_cache_gb", ecfg.kv_cache_gb)) is not None:
                raise named from e
            raise
    store = inputs.get("extract") if ckpt.source.get("kind") == "train" else None
    _compare_with_training(facts, ckpt.source, ecfg.num_speculative_tokens, store)
    meta = {"target": {**target.identity(), "name": target.path.name}, "draft": c.to_dict(), "format": ecfg.format,
            "architectures": written.get("architectures") or written.get("transformer_layer_config", {}).get(
                "architectures"), "dtype": dtype, "source": ckpt.source,
            "num_speculative_tokens": ecfg.num_speculative_tokens,
            "coverage": prep.facts.coverage if prep else None,
            "data": ({"prepare run": prep.config_hash[:12], "train samples": prep.facts.num_train,
                      "eval samples": prep.facts.num_eval} if prep else None)}
    (model_dir / "README.md").write_text(model_card(meta, facts))
    marker["verification"] = {k: facts[k] for k in ("acceptance_length", "acceptance_by_k", "tokens_per_step",
                                                     "num_prompts", "max_tokens") if k in facts}
    (model_dir / MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
    return facts


def export_semantics(ecfg, semantic_dict) -> dict:
    """The export section as hashed: the temperatures and their seed only when a temperature other
    than greedy is asked for, so runs recorded before they existed keep their config hash."""
    out = semantic_dict(ecfg)
    if [float(t) for t in ecfg.eval_temperatures] == [0.0]:
        out.pop("eval_temperatures", None)
        out.pop("eval_seed", None)
    return out


def _compare_with_training(facts: dict, source: dict, k: int, store=None) -> None:
    """The train stage's acceptance estimate (teacher-forced, on its eval split) next to vLLM's.
    ``store``: the extract run the draft was trained on, whose checks the warning quotes."""
    expected = source.get("train_expected_acceptance_length") or []
    if "acceptance_length" not in facts or len(expected) < k or expected[k - 1] is None:
        return
    facts["train_expected_acceptance_length"] = round(float(expected[k - 1]), 4)
    if facts["acceptance_length"] - 1 < 0.5 * (expected[k - 1] - 1):
        checks = ""
        if store is not None and store.facts is not None:
            checks = (f" The hidden states it was trained on (extract run {store.config_hash[:12]}): "
                      f"{store.facts.checks_line()}; a low agreement or a large parity error there means the draft "
                      f"learnt from states the target does not produce when serving.")
        log.warning("export: vLLM accepts %.3f tokens per step at k=%d, the train stage expected %.3f from its "
                    "held-out accuracies. Both measure the same draft (the offline evaluator agrees with vLLM), so the "
                    "served prompts differ from the training data: responses not written by the target (use "
                    "prepare.regenerate=true), another chat template, or another domain.%s",
                    facts["acceptance_length"], k, expected[k - 1], checks)


def _print_summary(rec) -> None:
    f = rec.facts
    print(f"export: {f.format} draft at {rec.exp_dir / f.model_dir}" +
          (f" (copied to {f.exported_to})" if f.exported_to else ""))
    if f.acceptance_length is not None:
        print(f"export: vLLM acceptance length {f.acceptance_length:.3f} at k={f.k} "
              f"(per position {f.acceptance_per_position}), by k {f.acceptance_by_k}; "
              f"{f.tokens_per_step:.3f} tokens per target step vs {f.ngram['tokens_per_step']:.3f} for prompt lookup; "
              f"offline evaluator (greedy) {f.offline['acceptance_length']:.3f}; lossless on {f.num_prompts} prompts")
    if f.lookup_summary:
        print(f"export: {f.lookup_summary}")
    for cat, d in (f.by_domain or {}).items():
        print(f"export: domain {cat} ({d['num_prompts']} prompts): vLLM acceptance length {d['acceptance_length']:.3f} "
              f"at k={f.k}, by k {d['acceptance_by_k']}")
    for t, row in (f.by_temperature or {}).items():
        if float(t) > 0:
            print(f"export: temperature {t} (seeded {f.sampling_seed}+i): vLLM acceptance length by k "
                  f"{row['acceptance_by_k']}; prompt lookup {row['ngram_tokens_per_step']:.3f} tokens per target step")
