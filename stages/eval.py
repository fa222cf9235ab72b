"""``python -m eagle3 stage=eval``: the offline evaluator alone (PyTorch, HF target, no vLLM).

Evaluates the draft that ``stage=export`` would export (the train stage's, or ``export.from=DIR``)
with chain speculative decoding, greedy, on the prepare stage's held-out prompts, for
k = ``export.num_speculative_tokens`` and each k in ``export.eval_ks``; records acceptance length,
per-position acceptance and tokens per target step in the manifest (stage ``eval``).
"""
from __future__ import annotations

import json
import logging

from eagle3.stage import Inputs, Stage

log = logging.getLogger("eagle3.eval")


class Eval(Stage):
    name = "eval"

    def consume(self, cfg, manifest) -> Inputs:
        from eagle3.export.sources import load_source
        from eagle3.target import resolve

        target = resolve(cfg.target, cfg.workspace)
        ckpt, upstream, prep, from_id = load_source(cfg, manifest, target, needs_prompts=True, stage="eval")
        k = cfg.export.num_speculative_tokens
        return Inputs(cfg=cfg, target=target, upstream=upstream, ckpt=ckpt, prep=prep, from_id=from_id,
                      dtype=target.run_dtype(cfg.target.dtype), k=k,
                      ks=[k] + sorted({int(x) for x in cfg.export.eval_ks} - {k}))

    def identity(self, inputs) -> dict:
        from eagle3.export.context_length import context_semantics
        from eagle3.export.prompts import prompts_identity

        export_cfg = inputs.cfg.export
        return {"k": inputs.k, "eval_ks": inputs.ks, "eval_prompts": export_cfg.eval_prompts,
                "eval_max_tokens": export_cfg.eval_max_tokens, "from": export_cfg.from_,
                "from_layer_convention": export_cfg.from_layer_convention, "from_identity": inputs.from_id,
                "dtype": inputs.dtype, "prompts_identity": prompts_identity(export_cfg), **context_semantics(export_cfg)}

    def work(self, job, inputs):
        from eagle3.contracts import EvalFacts
        from eagle3.export.context_length import eval_context_facts
        from eagle3.export.offline_eval import offline_acceptance_by_k
        from eagle3.export.prompts import held_out_prompts, stop_token_ids

        cfg, target, export_cfg = inputs.cfg, inputs.target, inputs.cfg.export
        prompts = held_out_prompts(export_cfg, inputs.prep, target.path, trust_remote_code=target.trust_remote_code)
        stop_ids = stop_token_ids(target.path, target.trust_remote_code)
        results = offline_acceptance_by_k(target, inputs.ckpt, prompts, inputs.ks, export_cfg.eval_max_tokens, stop_ids,
                                          dtype=inputs.dtype, device=export_cfg.device, progress=cfg.progress)
        main = results[inputs.k]
        facts = {**main.summary(), "max_tokens": export_cfg.eval_max_tokens, "source": inputs.ckpt.source,
                 "acceptance_by_k": {str(kk): round(r.acceptance_length, 4) for kk, r in results.items()},
                 "tokens_per_step_by_k": {str(kk): round(r.tokens_per_step, 4) for kk, r in results.items()},
                 **eval_context_facts(export_cfg, target, prompts, results, inputs.k)}
        (job.out_dir / "eval.json").write_text(json.dumps({**facts, "outputs": main.outputs}, indent=1) + "\n")
        job.add_output(job.out_dir / "eval.json")
        inputs.num_prompts = len(prompts)
        return EvalFacts(**facts)

    def report(self, record, inputs) -> None:
        from eagle3.export.context_length import summary_line

        f, k = record.facts, inputs.k
        print(f"eval: offline acceptance length {f.acceptance_length:.3f} at k={k} (per position "
              f"{f.acceptance_per_position}), by k {f.acceptance_by_k}, {f.tokens_per_step:.3f} "
              f"tokens per target step, {inputs.num_prompts} prompts (greedy decoding"
              + ("; export.eval_temperatures apply to vLLM verification only)" if any(
                  float(t) > 0 for t in inputs.cfg.export.eval_temperatures) else ")"))
        print(f"eval: offline {summary_line(f.by_context_length, k)}")


STAGE = Eval()
run = STAGE.run
