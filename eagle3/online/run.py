"""What ``stage=train`` (online) and ``stage=produce`` both set up from the config and the manifest
(:class:`OnlineRun`); for the train stage it is the online provider of its hidden states (the other
one: ``eagle3.train_inputs.StoreInput``)."""
from __future__ import annotations

import contextlib
from pathlib import Path

from .colocated import ColocatedSource
from .exchange import OnlineError, check_writable
from .external import ExternalSource
from .hidden_states import OnlineHiddenStates


class OnlineRun:
    """What ``stage=train`` (online) and ``stage=produce`` both derive from the config and the
    manifest: the target, the prepare run, the layout the producer must write, the train job (its
    config hash names the run and the default exchange directory) and the prepared splits."""

    def __init__(self, cfg, manifest):
        from ..extract import prepared_samples
        from ..extract.checks import refuse_known_bad
        from ..extract.layout import check_tokenizer, derive_store_layout
        from ..extract.reuse import extract_identity
        from ..target import resolve
        from ..train_inputs import train_run_config

        tcfg, extract_cfg, ocfg = cfg.train, cfg.extract, cfg.train.online
        self.cfg, self.ocfg = cfg, ocfg
        self.target = target = resolve(cfg.target, cfg.workspace)
        self.upstream = manifest.consume_upstream("train", target.identity(), only=("prepare",))
        self.prep = prep = self.upstream["prepare"]
        check_tokenizer(prep, target)
        if ocfg.producer == "colocated" and extract_cfg.backend != "hf":
            raise OnlineError(f"train.online.producer=colocated runs the target with the hf backend inside the "
                              f"training process, but extract.backend={extract_cfg.backend}: set extract.backend=hf, "
                              f"or train.online.producer=external to use {extract_cfg.backend} engines in their own "
                              f"processes (`python -m eagle3 stage=produce`)")
        prepared = prepared_samples(prep)
        # the store extract would write, from the splits it would read (and the training split, which
        # online training always reads): the same refusals as stage=extract
        derived = derive_store_layout(extract_cfg, target, cfg.target.dtype,
                                      {s: v.lengths for s, v in prepared.items()}, also=("train",))
        self.layer_ids = layer_ids = list(derived.layout.layer_ids)
        refuse_known_bad(target.config, extract_cfg.backend, layer_ids, target_dtype=derived.target_dtype,
                         target_path=target.path)
        self.derived = derived  # the one layout value (layout, target dtype, max_model_len): engines are built from it
        # what the producer's numbers depend on: in the config hash, checked between the processes
        self.identity, extract = extract_identity(self.layout, self.target_dtype, extract_cfg)
        self.producer = {**self.identity, "placement": ocfg.producer, "extract": extract}
        self.job = manifest.start("train", config=train_run_config(tcfg, layer_ids, {**self.identity, "extract": extract}),
                                  target=target.identity(), inputs=self.upstream)
        self.dir = Path(ocfg.dir).expanduser().resolve() if ocfg.dir else self.job.out_dir / "online"
        self.splits = {"train": prepared["train"]}
        if "eval" in derived.splits and len(prepared["eval"]):
            self.splits["eval"] = prepared["eval"]

    layout = property(lambda self: self.derived.layout)
    target_dtype = property(lambda self: self.derived.target_dtype)
    max_model_len = property(lambda self: self.derived.max_model_len)

    def extractor(self):
        """The producer's backend with the target loaded (``extract.*``); the hf backend on this
        process's GPU under torchrun / accelerate launch when ``extract.device=auto``."""
        import dataclasses

        from ..extract.backend import EngineSpec, make_extractor
        from ..launch import launch

        extract_cfg, local_rank = self.cfg.extract, launch().local_rank
        if extract_cfg.backend == "hf" and extract_cfg.device == "auto" and local_rank is not None:
            import torch

            if torch.cuda.is_available():
                extract_cfg = dataclasses.replace(extract_cfg, device=f"cuda:{local_rank}")
        return make_extractor(EngineSpec.of(self.target, self.derived, extract_cfg), self.dir)

    def stores(self, world_size: int, rank: int = 0) -> tuple:
        """(train store, eval store or None) for the trainer: OnlineHiddenStates over this run's source."""
        ocfg, tcfg = self.ocfg, self.cfg.train
        if tcfg.num_workers:
            raise OnlineError(f"train.hidden_states=online reads samples in the loop's order in the training "
                              f"process: set train.num_workers=0 (it is {tcfg.num_workers})")
        if ocfg.producer == "colocated":
            if ocfg.cache_bytes:
                check_writable(self.dir, "the online cache directory")
            source = ColocatedSource(self.extractor(), self.layout, self.dir, ocfg.cache_bytes)
        else:
            source = ExternalSource(self.trainer_link(rank, world_size), self.layout, ocfg, self.identity, rank=rank,
                                    world_size=world_size)
        train = OnlineHiddenStates("train", self.splits["train"], self.layout, source)
        ev = OnlineHiddenStates("eval", self.splits["eval"], self.layout, source) if "eval" in self.splits else None
        return train, ev

    # -- the train stage's input (eagle3.train_inputs: the same surface as StoreInput)
    def open(self) -> tuple:
        """(train split, eval split or None) for this process of the launch, and the stage's first line."""
        from ..train_inputs import world

        self._opened = self.stores(*world())
        ocfg = self.ocfg
        where = (f"exchange/cache directory {self.dir}" if ocfg.producer == "colocated" or ocfg.transport == "dir"
                 else self.where())
        print(f"train: online, {ocfg.producer} {self.cfg.extract.backend} producer, layers {self.layer_ids}, "
              f"{self.layout.dtype} states; {where}"
              + ("" if ocfg.producer == "colocated" else
                 " (start the producer: `python -m eagle3 stage=produce` with this run's overrides)"))
        return self._opened

    @contextlib.contextmanager
    def reading(self):
        """Around the training: the online store closed as finished (the producer may stop, the cache
        becomes a store if complete), or given up when the training fails (the trainer's heartbeat
        stops: producers see it gone)."""
        train_store = self._opened[0]
        try:
            yield
        except BaseException:
            train_store.close(finished=False)
            raise
        train_store.close(finished=True)

    def facts(self) -> dict:
        """What :class:`eagle3.contracts.TrainFacts` records of where the states came from."""
        return {"hidden_states": "online", "producer": self.producer,
                "cache_dir": str(self.dir) if self.ocfg.cache_bytes else None}

    # -- the exchange between producers and trainer (train.online.transport)
    @property
    def namespace(self) -> str:
        """The Mooncake keys' prefix: ``train.online.mooncake.namespace``, else one of the train run's config hash."""
        return self.ocfg.mooncake.namespace or f"eagle3-{self.job.config_hash[:16]}"

    def trainer_link(self, rank: int = 0, world_size: int = 1):
        """The trainer's side of the exchange: the directory (``train.online.dir``), or a Mooncake client whose
        master comes from ``train.online.mooncake.master``, the environment, or (one host) is started here."""
        ocfg = self.ocfg
        if ocfg.transport == "dir":
            return self.dir  # ExternalSource opens rank-<r>/ of it itself
        from .mooncake_exchange import (
            MooncakeTrainerLink,
            configured_master,
            local_master,
            secret_from_env,
            wait_for_local_master,
        )

        secret = secret_from_env()
        local = self.dir if world_size == 1 else self.dir / f"rank-{rank}"
        check_writable(self.dir, "the online directory (train.online.dir)")
        master, setting, proc = *configured_master(ocfg.mooncake), None
        if master and ocfg.mooncake.start_master and rank == 0:
            from .mooncake_exchange import start_master_at

            proc = start_master_at(master, setting, self.dir / "mooncake-master.log")
        if not master:
            from ..launch import launch

            if not launch().one_host:
                raise OnlineError("train.online.transport=mooncake with a trainer on several hosts needs a Mooncake "
                                  "master every host reaches: set train.online.mooncake.master=<host>:<port> (or env "
                                  "EAGLE3_MOONCAKE_MASTER); start it with `mooncake_master --rpc_address=<host> "
                                  "--rpc_port=<port>` (docs/online.md)")
            if rank == 0:
                master, proc = local_master(self.dir, self.dir / "mooncake-master.log")
            else:
                master = wait_for_local_master(self.dir, ocfg.timeout_s, ocfg.poll_s)
            setting = "the master this trainer started (train.online.mooncake.master unset)"
        return MooncakeTrainerLink(master, self.namespace, local, ocfg.mooncake, self.layout, self.identity,
                                   window_bytes=ocfg.window_bytes, timeout_s=ocfg.timeout_s, rank=rank,
                                   setting=setting, secret=secret, master_proc=proc, poll_s=ocfg.poll_s)

    def producer_link(self, part: int = 0, parts: int = 1):
        """The producer's side of the exchange (:meth:`trainer_link`'s counterpart); a producer on the trainer's
        host with no master given uses the one the trainer started (waiting for it up to
        ``train.online.idle_timeout_s``)."""
        ocfg = self.ocfg
        if ocfg.transport == "dir":
            return self.dir
        from .mooncake_exchange import MooncakeProducerLink, configured_master, secret_from_env, wait_for_local_master

        secret = secret_from_env()
        master, setting = configured_master(ocfg.mooncake)
        if not master:
            master = wait_for_local_master(self.dir, ocfg.idle_timeout_s, ocfg.poll_s)
            setting = f"the master the trainer on this host started ({self.dir}/mooncake-master.json)"
        timeout = ocfg.idle_timeout_s or ocfg.timeout_s
        return MooncakeProducerLink(master, self.namespace, self.dir / f"staging-{part}-of-{parts}", ocfg.mooncake,
                                    self.layout, timeout_s=timeout, setting=setting, secret=secret,
                                    poll_s=ocfg.poll_s)

    def where(self) -> str:
        """Where this run's exchange is, for the stages' first line."""
        if self.ocfg.transport == "dir":
            return f"exchange directory {self.dir}"
        from .mooncake_exchange import configured_master

        master, setting = configured_master(self.ocfg.mooncake)
        return (f"Mooncake exchange (namespace {self.namespace}, master {master or 'started by the trainer'}"
                f"{f' from {setting}' if master else ''}; local directory {self.dir})")
