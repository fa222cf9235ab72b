"""A draft in memory, under vLLM's tensor names, independent of where it came from and where it goes.

Every writer takes a :class:`DraftCheckpoint` and every importer returns one, so a format is only
ever a renaming of these tensors plus a config file. The expected names and shapes are those of
:class:`eagle3.model.draft.Eagle3Draft` for the checkpoint's config (built on the meta device), so
this module cannot drift from the trained model.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from ..model.draft import Eagle3Draft, Eagle3DraftConfig
from .errors import ExportError

MAPPING_NAMES = ("d2t", "t2d")
EMBED_NAME = "embed_tokens.weight"


def expected_shapes(cfg: Eagle3DraftConfig) -> dict[str, tuple]:
    """Trainable tensor name -> shape for a draft of config ``cfg`` (no d2t/t2d, no embedding)."""
    with torch.device("meta"):
        module = Eagle3Draft(cfg)
    return {k: tuple(v.shape) for k, v in module.state_dict().items() if k not in MAPPING_NAMES}


@dataclass
class DraftCheckpoint:
    config: Eagle3DraftConfig
    tensors: dict  # name -> tensor, vLLM names (fc.weight, midlayer.*, norm.weight, lm_head.weight)
    d2t: torch.Tensor  # int64 [draft_vocab]: target id = draft id + d2t[draft id]
    t2d: torch.Tensor  # bool [target vocab]
    embed: Optional[torch.Tensor] = None  # the draft's own embed_tokens, when its source had one
    source: dict = field(default_factory=dict)  # provenance, written into the export's metadata

    @property
    def identity_mapping(self) -> bool:
        return self.config.draft_vocab_size == self.config.vocab_size and not bool(self.d2t.any())

    @property
    def kept_ids(self) -> torch.Tensor:
        return torch.arange(self.d2t.numel(), dtype=torch.long) + self.d2t.long()

    def validate(self) -> "DraftCheckpoint":
        """Names, shapes and the vocabulary mapping agree with the config, or an ExportError says how not."""
        cfg = self.config
        want = expected_shapes(cfg)
        missing = sorted(set(want) - set(self.tensors))
        extra = sorted(set(self.tensors) - set(want))
        for option, prefix in (("norm_before_fc", "input_norm."), ("fc_norm", "fc_norm.")):
            if getattr(cfg, option) and any(n.startswith(prefix) for n in missing):
                raise ExportError(f"the draft's config sets {option}=true but its weights have no {prefix}* tensor "
                                  f"(missing {[n for n in missing if n.startswith(prefix)]}); vLLM would run it with "
                                  f"that norm's weight left at its initial value. Set {option} to false in its "
                                  f"config.json if the draft was trained without it, or supply the trained weights.")
            if not getattr(cfg, option) and any(n.startswith(prefix) for n in extra):
                raise ExportError(f"the draft's weights hold {prefix}* tensors but its config does not set {option}: "
                                  f"vLLM would not apply that norm (llama_eagle3.py drops input_norm.* when "
                                  f"norm_before_fc is false). Set {option}=true in its config.json.")
        if missing or extra:
            raise ExportError(f"the draft's tensors do not match its config: missing {missing[:8]}, unexpected "
                              f"{extra[:8]}")
        bad = {k: (tuple(self.tensors[k].shape), s) for k, s in want.items() if tuple(self.tensors[k].shape) != s}
        if bad:
            hint = ""
            if "fc.weight" in bad:
                n_in = bad["fc.weight"][0][1]
                hint = (f" fc takes {n_in} inputs = {n_in / cfg.target_hidden_size:g} aux states of width "
                        f"{cfg.target_hidden_size}, but the layer ids {cfg.aux_layer_ids} name "
                        f"{len(cfg.aux_layer_ids)}: the draft was trained on other layers than the ones given.")
            raise ExportError(f"tensor shapes differ from the config (name: (found, expected)): {bad}.{hint}")
        if tuple(self.d2t.shape) != (cfg.draft_vocab_size,) or tuple(self.t2d.shape) != (cfg.vocab_size,):
            raise ExportError(f"vocabulary mapping shapes d2t {tuple(self.d2t.shape)}, t2d {tuple(self.t2d.shape)} do "
                              f"not fit draft vocab {cfg.draft_vocab_size} / target vocab {cfg.vocab_size}")
        kept = self.kept_ids
        if int(kept.min()) < 0 or int(kept.max()) >= cfg.vocab_size:
            raise ExportError(f"d2t maps draft ids outside the target vocabulary [0, {cfg.vocab_size})")
        if len(set(kept.tolist())) != kept.numel():
            raise ExportError("d2t maps two draft ids to the same target id")
        if not bool(self.t2d[kept].all()) or int(self.t2d.sum()) != kept.numel():
            raise ExportError("t2d does not mark exactly the target ids that d2t maps to")
        if self.embed is not None and tuple(self.embed.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise ExportError(f"embed_tokens {tuple(self.embed.shape)} is not [vocab {cfg.vocab_size}, hidden "
                              f"{cfg.hidden_size}]")
        return self

    def to_module(self, dtype: torch.dtype = torch.float32, device="cpu") -> Eagle3Draft:
        """An :class:`Eagle3Draft` holding these weights (for the offline evaluator)."""
        module = Eagle3Draft(self.config)
        state = {k: v for k, v in self.tensors.items()}
        state["d2t"], state["t2d"] = self.d2t.long(), self.t2d.bool()
        module.load_state_dict(state, strict=True)
        return module.to(device=device, dtype=dtype).eval()

    def to(self, dtype: torch.dtype) -> "DraftCheckpoint":
        cast = {k: v.detach().to("cpu", dtype).contiguous() for k, v in self.tensors.items()}
        embed = None if self.embed is None else self.embed.detach().to("cpu", dtype).contiguous()
        return DraftCheckpoint(self.config, cast, self.d2t.long().contiguous(), self.t2d.bool().contiguous(),
                               embed, dict(self.source))


def from_module(module: Eagle3Draft, source: Optional[dict] = None) -> DraftCheckpoint:
    state = {k: v.detach().cpu() for k, v in module.state_dict().items()}
    d2t, t2d = state.pop("d2t"), state.pop("t2d")
    return DraftCheckpoint(module.config, state, d2t, t2d, None, dict(source or {})).validate()
