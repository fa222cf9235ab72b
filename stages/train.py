"""Stage 3, train: the EAGLE-3 draft from the extract stage's hidden states (eagle3/train/).

Inputs through the manifest: prepare's vocabulary mapping (``vocab.safetensors``) and the extract
run's store (its layer ids, hidden size and dtype are facts); with ``train.hidden_states=online``
prepare's dataset instead, the states computed while training (eagle3/online/), and the
producer's settings recorded as ``TrainFacts.producer``. The target's embedding, final norm and
lm_head are read from the checkpoint alone (eagle3.target_weights), never the whole model.
Outputs in the run's directory: ``draft.safetensors`` (vLLM tensor names, float32),
``draft_config.json`` (eagle3.model.Eagle3DraftConfig), ``draft_vllm_config.json`` (vLLM's
config.json for it), ``metrics.jsonl`` and ``checkpoints/`` (resumable). Multi-GPU:
``accelerate launch -m eagle3 stage=train``; only the main process records the run
(``StageJob.across_ranks``). The store's opening and checks and the draft's inputs:
eagle3/train/inputs.py: every shard's digest before the first step, every sample's checksum as it
is read (a store without them: every shard again at the end), the store's outputs digest recorded
(``read``: a store rewritten with other bytes later makes the run stale, and it runs again from
step 0).
"""
from __future__ import annotations

import os


def run(cfg, manifest):
    from eagle3.artifacts import DRAFT_CONFIG_FILE, DRAFT_FILE, METRICS_FILE, VLLM_CONFIG_FILE
    from eagle3.contracts import TrainFacts
    from eagle3.hashing import semantic_dict
    from eagle3.target import resolve
    from eagle3.train.inputs import check_reads, open_store, result_line, train_inputs, verify_store
    from eagle3.train.loop import train

    tcfg = cfg.train
    online = None
    if tcfg.hidden_states == "online":  # no extract run: the states are computed while training
        from eagle3.online import OnlineRun

        online = OnlineRun(cfg, manifest)
        target, upstream, prep, job = online.target, online.upstream, online.prep, online.job
        layer_ids = list(online.layer_ids)
    else:
        target = resolve(cfg.target, cfg.workspace)
        upstream = manifest.consume_upstream("train", target.identity(), cfg=cfg)
        prep, ext = upstream["prepare"], upstream["extract"]
        layer_ids = [int(i) for i in ext.facts.layer_ids]
        config = {"train": semantic_dict(tcfg), "layer_ids": layer_ids}
        job = manifest.start("train", config=config, target=target.identity(), inputs=upstream)
    if (done := job.across_ranks().claim()) is not None:  # every process of the launch trains its share
        return done

    if online is not None:
        train_store, eval_store = online.stores(int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0")))
        where = (f"exchange/cache directory {online.dir}" if online.ocfg.producer == "colocated"
                 or online.ocfg.transport == "dir" else online.where())
        print(f"train: online, {online.ocfg.producer} {cfg.extract.backend} producer, layers {layer_ids}, "
              f"{online.layout.dtype} states; {where}"
              + ("" if online.ocfg.producer == "colocated" else
                 " (start the producer: `python -m eagle3 stage=produce` with this run's overrides)"))
    else:
        train_store, eval_store = open_store(ext, layer_ids)
        checked = check_reads(job, (train_store, eval_store))
    inputs = train_inputs(cfg, target, prep, layer_ids, train_store, eval_store)
    with job:
        if online is None:
            verify_store(ext, cfg.progress and job.is_main)
        try:
            # a stale earlier attempt (its store rewritten since): from step 0, its checkpoints removed
            result = train(tcfg, inputs, job.out_dir, log_fn=job.log, progress=cfg.progress and job.is_main,
                           fresh=job.stale is not None)
        except BaseException:
            if online is not None:  # reads given up, the trainer's heartbeat stopped (producers see it gone)
                train_store.close(finished=False)
            raise
        if online is not None:  # an online store: the producer may stop, the cache becomes a store if complete
            train_store.close(finished=True)
        elif not checked and job.is_main:  # damage while it was read, found before the run is complete
            verify_store(ext, cfg.progress, again=True)
        for name in (DRAFT_FILE, DRAFT_CONFIG_FILE, VLLM_CONFIG_FILE, METRICS_FILE):
            job.add_output(job.out_dir / name)
        job.facts = TrainFacts(steps=result.steps, ttt_steps=tcfg.ttt_steps, layer_ids=layer_ids,
                               draft_vocab_size=inputs.draft_config.draft_vocab_size, train=result.train,
                               eval=result.eval, hidden_states=tcfg.hidden_states,
                               producer=online.producer if online is not None else None,
                               cache_dir=str(online.dir) if online is not None and online.ocfg.cache_bytes else None)
    if job.is_main:
        print(result_line(result, tcfg.ttt_steps))
    return job.record
