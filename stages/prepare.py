"""Stage 1, prepare: conversations -> chat template -> token ids with an assistant-only loss mask,
optional regeneration by the target, token frequencies and the draft vocabulary mapping.

Library: ``eagle3.data`` (sources, chat template, regeneration, dataset, vocab; the stage's work
in ``eagle3.data.build``, which derives ``stats.json`` from the facts). Outputs: the
dataset, ``vocab.safetensors``, ``token_freq.safetensors``, ``stats.json`` (``eagle3.artifacts``)
and :class:`eagle3.contracts.PrepareFacts`.
"""
from __future__ import annotations

from eagle3.stage import Inputs, Stage


class Prepare(Stage):
    name = "prepare"

    def consume(self, cfg, manifest) -> Inputs:
        from eagle3.target import resolve

        target = resolve(cfg.target, cfg.workspace)
        if cfg.prepare.regenerate:  # an engine known to compute this target wrong would write the answers
            from eagle3.extract.checks import refuse_known_bad

            refuse_known_bad(target.config, cfg.prepare.regen.backend, setting="prepare.regen.backend",
                             target_path=target.path)
        return Inputs(cfg=cfg, target=target, upstream=manifest.consume_upstream("prepare", target.identity()))

    def identity(self, inputs) -> dict:
        from eagle3.data.dataset import prepare_config

        return prepare_config(inputs.cfg)

    def before(self, job, inputs) -> None:
        from eagle3.data.build import check_chat_template
        from eagle3.target import load_tokenizer

        inputs.tokenizer = load_tokenizer(inputs.target, inputs.cfg.target.chat_template)
        check_chat_template(inputs.tokenizer, inputs.target)

    def work(self, job, inputs):
        from eagle3.data.build import build_dataset

        prepared = build_dataset(inputs.cfg, inputs.target, inputs.tokenizer, job.out_dir)
        for path in prepared.outputs:
            job.add_output(path)
        job.log({f"prepare/{k}": v for k, v in prepared.stats.items() if isinstance(v, (int, float))})
        print(f"prepare: draft vocabulary coverage of trainable tokens: {prepared.facts.coverage_line()}")
        if prepared.facts.vocab_choice:  # prepare.draft_vocab_size=auto
            print(f"prepare: {prepared.facts.vocab_choice_line()}")
        return prepared.facts


STAGE = Prepare()
run = STAGE.run
