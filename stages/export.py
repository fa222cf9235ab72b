"""Stage 4, export: the trained draft (or one trained elsewhere, ``export.from=DIR``) -> a directory
vLLM (or SGLang) serves, verified in the real vLLM: it loads, it is lossless, its acceptance
length agrees with the offline evaluator's for the trained draft, and it is compared with prompt
lookup. The export lives in the experiment (``export/<hash>/model``, recorded with its facts in the
manifest); ``export.out_dir`` additionally receives a copy, never over another model unless
``export.overwrite=true``, and swapped in only once it is complete beside the draft it replaces
(eagle3/export/outdir.py). The steps (writing, verification, the facts the marker and the model
card are derived from, the summary): eagle3/export/pipeline.py.
"""
from __future__ import annotations

from eagle3.stage import Inputs, Stage


class Export(Stage):
    name = "export"

    def consume(self, cfg, manifest) -> Inputs:
        from eagle3.export.outdir import refuse_inputs
        from eagle3.export.pipeline import run_inputs
        from eagle3.export.sources import check_embedding, load_source
        from eagle3.target import resolve

        export_cfg = cfg.export
        target = resolve(cfg.target, cfg.workspace)
        if export_cfg.out_dir:  # never over what this run reads, whatever export.overwrite says
            refuse_inputs(export_cfg.out_dir, run_inputs(cfg, target.path, manifest.exp_dir))
        ckpt, upstream, prep, from_id = load_source(cfg, manifest, target, needs_prompts=export_cfg.verify)
        check_embedding(ckpt, target, export_cfg.include_embedding)
        return Inputs(cfg=cfg, target=target, upstream=upstream, ckpt=ckpt, prep=prep, from_id=from_id,
                      dtype=target.run_dtype(cfg.target.dtype))

    def identity(self, inputs) -> dict:
        from eagle3.export.pipeline import export_semantics
        from eagle3.export.prompts import prompts_identity
        from eagle3.hashing import semantic_dict

        export_cfg = inputs.cfg.export
        return {"export": export_semantics(export_cfg, semantic_dict), "dtype": inputs.dtype,
                "from_identity": inputs.from_id, "prompts_identity": prompts_identity(export_cfg)}

    def complete_already(self, done, inputs) -> None:
        from eagle3.artifacts import MODEL_DIR
        from eagle3.export.outdir import publish

        export_cfg = inputs.cfg.export
        if export_cfg.out_dir:
            action = publish(done.out_dir / MODEL_DIR, export_cfg.out_dir, export_cfg.overwrite)
            said = {"same": "already up to date", "repair": "copied again (its files did not match its marker)"}
            print(f"export: {export_cfg.out_dir}: {said.get(action, 'copied')}")

    def before(self, job, inputs) -> None:
        from eagle3.export.outdir import precheck_destination
        from eagle3.export.pipeline import check_kv_fits

        export_cfg = inputs.cfg.export
        if export_cfg.out_dir:  # refuse a taken destination before spending minutes on verification
            precheck_destination(export_cfg.out_dir, export_cfg.overwrite)
        if export_cfg.verify:  # a KV cache that cannot fit, named by its eagle3 key, before any engine starts
            check_kv_fits(export_cfg, inputs.target, inputs.ckpt)

    def work(self, job, inputs):
        from eagle3.artifacts import MODEL_DIR
        from eagle3.export.pipeline import export_verified

        final_dir = job.out_dir / MODEL_DIR
        facts = export_verified(inputs.cfg, job, inputs.target, inputs.ckpt, inputs.upstream, inputs.prep, inputs.dtype,
                                final_dir)  # and publishes it
        job.add_output(final_dir)
        return facts

    def report(self, record, inputs) -> None:
        from eagle3.export.pipeline import print_summary

        print_summary(record)


STAGE = Export()
run = STAGE.run
