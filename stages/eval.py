"""``python -m eagle3 stage=eval``: the offline evaluator alone (PyTorch, HF target, no vLLM).

Evaluates the draft that ``stage=export`` would export (the train stage's, or ``export.from=DIR``)
with chain speculative decoding, greedy, on the prepare stage's held-out prompts, for
k = ``export.num_speculative_tokens`` and each k in ``export.eval_ks``; records acceptance length,
per-position acceptance and tokens per target step in the manifest (stage ``eval``).
"""
from __future__ import annotations

import json
import logging

log = logging.getLogger("eagle3.eval")


def run(cfg, manifest):
    from eagle3.contracts import EvalFacts
    from eagle3.export.context_length import context_semantics, eval_context_facts, summary_line
    from eagle3.export.offline_eval import offline_acceptance_by_k
    from eagle3.export.prompts import held_out_prompts, prompts_identity, stop_token_ids
    from eagle3.export.sources import load_source
    from eagle3.target import resolve

    export_cfg = cfg.export
    target = resolve(cfg.target, cfg.workspace)
    ckpt, inputs, prep, from_id = load_source(cfg, manifest, target, needs_prompts=True, stage="eval")
    dtype = target.run_dtype(cfg.target.dtype)
    k = export_cfg.num_speculative_tokens
    ks = [k] + sorted({int(x) for x in export_cfg.eval_ks} - {k})
    config = {"k": k, "eval_ks": ks, "eval_prompts": export_cfg.eval_prompts, "eval_max_tokens": export_cfg.eval_max_tokens,
              "from": export_cfg.from_, "from_layer_convention": export_cfg.from_layer_convention, "from_identity": from_id,
              "dtype": dtype, "prompts_identity": prompts_identity(export_cfg), **context_semantics(export_cfg)}
    job = manifest.start("eval", config=config, target=target.identity(), inputs=inputs)
    if (done := job.claim()) is not None:
        return done
    with job:
        prompts = held_out_prompts(export_cfg, prep, target.path, trust_remote_code=target.trust_remote_code)
        stop_ids = stop_token_ids(target.path, target.trust_remote_code)
        results = offline_acceptance_by_k(target, ckpt, prompts, ks, export_cfg.eval_max_tokens, stop_ids,
                                          dtype=dtype, device=export_cfg.device, progress=cfg.progress)
        main = results[k]
        facts = {**main.summary(), "max_tokens": export_cfg.eval_max_tokens, "source": ckpt.source,
                 "acceptance_by_k": {str(kk): round(r.acceptance_length, 4) for kk, r in results.items()},
                 "tokens_per_step_by_k": {str(kk): round(r.tokens_per_step, 4) for kk, r in results.items()},
                 **eval_context_facts(export_cfg, target, prompts, results, k)}
        (job.out_dir / "eval.json").write_text(json.dumps({**facts, "outputs": main.outputs}, indent=1) + "\n")
        job.add_output(job.out_dir / "eval.json")
        job.facts = EvalFacts(**facts)
    print(f"eval: offline acceptance length {facts['acceptance_length']:.3f} at k={k} (per position "
          f"{facts['acceptance_per_position']}), by k {facts['acceptance_by_k']}, {facts['tokens_per_step']:.3f} "
          f"tokens per target step, {len(prompts)} prompts (greedy decoding"
          + ("; export.eval_temperatures apply to vLLM verification only)" if any(
              float(t) > 0 for t in export_cfg.eval_temperatures) else ")"))
    print(f"eval: offline {summary_line(facts['by_context_length'], k)}")
    return job.record
