"""Stage 3, train: the EAGLE-3 draft from the extract stage's hidden states (eagle3/train/).

Inputs through the manifest: prepare's vocabulary mapping (``vocab.safetensors``) and the hidden
states from one of two providers (eagle3/train_inputs.py), which the stage does not tell apart: the
extract run's store (its layer ids, hidden size and dtype are facts), or with
``train.hidden_states=online`` prepare's dataset, the states computed while training
(eagle3/online/) and the producer's settings recorded as ``TrainFacts.producer``. The target's
embedding, final norm and lm_head are read from the checkpoint alone (eagle3.target_weights), never
the whole model. Outputs in the run's directory: ``draft.safetensors`` (vLLM tensor names, float32),
``draft_config.json`` (eagle3.model.Eagle3DraftConfig), ``draft_vllm_config.json`` (vLLM's
config.json for it), ``metrics.jsonl`` and ``checkpoints/`` (resumable). Multi-GPU:
``accelerate launch -m eagle3 stage=train``; only the main process records the run
(``StageJob.across_ranks``). A store is checked as it is read: every shard's digest before the first
step, every sample's checksum as it is read (a store without them: every shard again at the end),
the store's outputs digest recorded (``read``: a store rewritten with other bytes later makes the
run stale, and it runs again from step 0).
"""
from __future__ import annotations

from eagle3.stage import Inputs, Stage


class Train(Stage):
    name = "train"

    def consume(self, cfg, manifest) -> Inputs:
        from eagle3.train_inputs import StoreInput

        provider = StoreInput  # the extract run's store on disk
        if cfg.train.hidden_states == "online":  # no extract run: the states are computed while training
            from eagle3.online import OnlineRun as provider
        source = provider(cfg, manifest)  # its upstream resolved, the run's identity derived, its job started
        return Inputs(cfg=cfg, target=source.target, upstream=source.upstream, source=source)

    def identity(self, inputs) -> dict:
        return inputs.source.job.config  # eagle3.train_inputs.train_run_config, from the provider's layers

    def start(self, manifest, inputs):
        return inputs.source.job.across_ranks()  # every process of the launch trains its share

    def before(self, job, inputs) -> None:
        from eagle3.train_inputs import train_inputs

        source = inputs.source
        train_store, eval_store = source.open()
        inputs.train = train_inputs(inputs.cfg, source.target, source.prep, source.layer_ids, train_store, eval_store)

    def work(self, job, inputs):
        from eagle3.artifacts import DRAFT_CONFIG_FILE, DRAFT_FILE, METRICS_FILE, VLLM_CONFIG_FILE
        from eagle3.contracts import TrainFacts
        from eagle3.train.loop import train

        cfg, tcfg, source = inputs.cfg, inputs.cfg.train, inputs.source
        with source.reading():
            # a stale earlier attempt (its store rewritten since): from step 0, its checkpoints removed
            inputs.result = result = train(tcfg, inputs.train, job.out_dir, log_fn=job.log,
                                           progress=cfg.progress and job.is_main, fresh=job.stale is not None)
        for name in (DRAFT_FILE, DRAFT_CONFIG_FILE, VLLM_CONFIG_FILE, METRICS_FILE):
            job.add_output(job.out_dir / name)
        return TrainFacts(steps=result.steps, ttt_steps=tcfg.ttt_steps, layer_ids=list(source.layer_ids),
                          draft_vocab_size=inputs.train.draft_config.draft_vocab_size, train=result.train,
                          eval=result.eval, mixed_precision=result.mixed_precision, **source.facts())

    def report(self, record, inputs) -> None:
        from eagle3.train_inputs import result_line

        print(result_line(inputs.result, inputs.cfg.train.ttt_steps))


STAGE = Train()
run = STAGE.run
