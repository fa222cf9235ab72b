"""What ``stage=train`` (online) and ``stage=produce`` both set up from the config and the manifest
(:class:`OnlineRun`)."""
from __future__ import annotations

import os
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
        from ..artifacts import DATASET_DIR
        from ..extract import DatasetSamples
        from ..extract.checks import refuse_known_bad
        from ..extract.layout import check_tokenizer, derive_store_layout
        from ..extract.reuse import extract_identity
        from ..hashing import semantic_dict
        from ..target import resolve

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
        import datasets

        ds = datasets.load_from_disk(str(prep.path(DATASET_DIR)))
        prepared = {s: DatasetSamples(ds[s]) for s in ds}
        # the store extract would write, from the splits it would read (and the training split, which
        # online training always reads): the same refusals as stage=extract
        derived = derive_store_layout(extract_cfg, target, cfg.target.dtype,
                                      {s: v.lengths for s, v in prepared.items()}, also=("train",))
        self.layer_ids = layer_ids = list(derived.layer_ids)
        refuse_known_bad(target.config, extract_cfg.backend, layer_ids)
        self.target_dtype, self.layout, self.max_model_len = derived.target_dtype, derived.layout, derived.max_model_len
        # what the producer's numbers depend on: in the config hash, checked between the processes
        self.identity, extract = extract_identity(self.layout, self.target_dtype, extract_cfg)
        self.producer = {**self.identity, "placement": ocfg.producer, "extract": extract}
        config = {"train": semantic_dict(tcfg), "layer_ids": layer_ids, "hidden_states": "online",
                  "producer": {**self.identity, "extract": extract}}
        self.job = manifest.start("train", config=config, target=target.identity(), inputs=self.upstream)
        self.dir = Path(ocfg.dir).expanduser().resolve() if ocfg.dir else self.job.out_dir / "online"
        self.splits = {"train": prepared["train"]}
        if "eval" in derived.splits and len(prepared["eval"]):
            self.splits["eval"] = prepared["eval"]

    def extractor(self):
        """The producer's backend with the target loaded (``extract.*``); the hf backend on this
        process's GPU under torchrun / accelerate launch when ``extract.device=auto``."""
        import dataclasses

        from ..extract.backend import make_extractor

        extract_cfg = self.cfg.extract
        if extract_cfg.backend == "hf" and extract_cfg.device == "auto" and "LOCAL_RANK" in os.environ:
            import torch

            if torch.cuda.is_available():
                extract_cfg = dataclasses.replace(extract_cfg, device=f"cuda:{os.environ['LOCAL_RANK']}")
        return make_extractor(extract_cfg.backend, self.target.path, self.layout, self.target_dtype, extract_cfg,
                              self.max_model_len, self.dir, trust_remote_code=self.target.trust_remote_code)

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
            source = ExternalSource(self.dir, self.layout, ocfg, self.identity, rank=rank, world_size=world_size)
        train = OnlineHiddenStates("train", self.splits["train"], self.layout, source)
        ev = OnlineHiddenStates("eval", self.splits["eval"], self.layout, source) if "eval" in self.splits else None
        return train, ev
