"""Stage 1, prepare: conversations -> chat template -> token ids with an assistant-only loss mask,
optional regeneration by the target, token frequencies and the draft vocabulary mapping.

Library: ``eagle3.data`` (sources, chat template, regeneration, dataset, vocab; the stage's work
in ``eagle3.data.build``, which derives ``stats.json`` from the facts). Outputs: the
dataset, ``vocab.safetensors``, ``token_freq.safetensors``, ``stats.json`` (``eagle3.artifacts``)
and :class:`eagle3.contracts.PrepareFacts`.
"""
from __future__ import annotations


def run(cfg, manifest):
    from eagle3.data.build import build_dataset, check_chat_template
    from eagle3.data.dataset import prepare_config
    from eagle3.target import load_tokenizer, resolve

    target = resolve(cfg.target, cfg.workspace)
    if cfg.prepare.regenerate:  # an engine known to compute this target wrong would write the answers
        from eagle3.extract.checks import refuse_known_bad

        refuse_known_bad(target.config, cfg.prepare.regen.backend, setting="prepare.regen.backend",
                         target_path=target.path)
    config = prepare_config(cfg)
    job = manifest.start("prepare", config=config, target=target.identity(),
                         inputs=manifest.consume_upstream("prepare", target.identity()))
    if (done := job.claim()) is not None:
        return done
    tokenizer = load_tokenizer(target, cfg.target.chat_template)
    check_chat_template(tokenizer, target)
    with job:
        prepared = build_dataset(cfg, target, tokenizer, job.out_dir)
        for path in prepared.outputs:
            job.add_output(path)
        job.log({f"prepare/{k}": v for k, v in prepared.stats.items() if isinstance(v, (int, float))})
        job.facts = prepared.facts
        print(f"prepare: draft vocabulary coverage of trainable tokens: {job.facts.coverage_line()}")
    return job.record
