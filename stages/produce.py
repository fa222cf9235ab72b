"""``stage=produce``: an online producer (eagle3/online/) for a train run with
``train.hidden_states=online train.online.producer=external``.

Started with the trainer's overrides (the same target, prepare run and extract settings), it finds
the same train run (its config hash) and hence the same exchange directory (``train.online.dir``,
default ``online/`` in the train run's directory), loads the target with ``extract.backend`` (any
backend, any ``extract.tensor_parallel_size``) and writes the shards the trainer needs next, in the
store's format, never more than ``train.online.window_bytes`` ahead. It records nothing in the
manifest (the train run does) and exits when the trainer has finished, or with an error when no
trainer has shown life for ``train.online.idle_timeout_s`` (600 s; 0 = wait forever). Killed, it
is simply started again: it resumes from what is on disk (or in the Mooncake store). Several producers (engines) share the work as the extract
stage's scale-out does: ``extract.num_shards=N extract.shard_index=p`` (producer p writes the samples
i with i % N == p). With ``train.online.transport=mooncake`` the producer and the trainer share no filesystem: samples, reading
order and heartbeats go through a Mooncake master (``train.online.mooncake.master``; docs/online.md). On
SLURM, a producer job and a trainer job:

    python -m eagle3 -m stage=produce train.hidden_states=online train.online.producer=external \\
        train.online.dir=/shared/online hydra/launcher=submitit_slurm ...
"""
from __future__ import annotations


def run(cfg, manifest):
    from eagle3.online import OnlineError, OnlineRun, produce

    if cfg.train.hidden_states != "online" or cfg.train.online.producer != "external":
        raise OnlineError("stage=produce serves a train run with train.hidden_states=online "
                          "train.online.producer=external: pass the trainer's overrides")
    run_ = OnlineRun(cfg, manifest)
    rec = manifest.record("train", run_.job.config_hash)
    if rec is not None and rec.status == "complete":
        print(f"produce: the train run {run_.job.config_hash[:12]} is complete already; nothing to produce")
        return None
    part = f" part {cfg.extract.shard_index} of {cfg.extract.num_shards}," if cfg.extract.num_shards > 1 else ""
    print(f"produce:{part} {cfg.extract.backend} producer, layers {run_.layer_ids}, {run_.layout.dtype} states, for train "
          f"run {run_.job.config_hash[:12]}; {run_.where()}")
    link = run_.producer_link(cfg.extract.shard_index, cfg.extract.num_shards)  # the master answers, or an error
    extractor = run_.extractor()
    try:
        stats = produce(link, run_.splits, run_.layout, extractor, run_.identity, poll_s=cfg.train.online.poll_s,
                        idle_timeout_s=cfg.train.online.idle_timeout_s, progress=cfg.progress,
                        part=cfg.extract.shard_index, parts=cfg.extract.num_shards)
    finally:
        extractor.close()
    print(f"produce: the trainer finished; {stats['written']} samples written for {stats['plans']} plan(s)")
    return None
