"""The stage graph and what each stage promises the next: one dataclass of facts per stage.

A stage's run is recorded in the manifest (``eagle3.manifest``) with its config, upstream runs,
outputs (sizes, sha256) and its *facts*: the numbers and identities later stages, reports and
users rely on (tokenizer identity, layer ids, hidden size, store dtype, the trained draft's
held-out accuracy per TTT step, vLLM's acceptance length...). Each stage's facts are a dataclass
here, serialised into the manifest as a plain JSON object under the field names below, so
``manifest.json`` stays readable by a person and by ``jq``.

What this module deliberately does not do: it runs nothing and imports nothing heavy (no torch),
so the CLI's ``--help`` and ``stage=status`` stay instant.

Changing a field here changes the manifest's format: bump ``eagle3.manifest.SCHEMA_VERSION`` and
teach :func:`upgrade_facts` to read the previous version. Adding an optional field with a default
does not: an older manifest lacks it and reads as the default (``Facts.from_json`` fills in only
the keys present), as ``ExtractFacts.agreement``/``agreement_threshold``/``parity`` were added
(None in runs recorded before the store checks existed).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from .store_layout import StoreLayout

# The pipeline, in order. `eval` (the offline evaluator alone) is a side stage: nothing consumes it.
STAGES = ("prepare", "extract", "train", "export")
UPSTREAM: dict[str, tuple[str, ...]] = {
    "prepare": (),
    "extract": ("prepare",),
    "train": ("prepare", "extract"),
    "export": ("prepare", "extract", "train"),
    "eval": ("prepare", "extract", "train"),
}


def downstream(stage: str) -> list[str]:
    """The stages that consume ``stage``'s output directly."""
    return [s for s, ups in UPSTREAM.items() if stage in ups]


class Facts:
    """Base of every stage's facts: JSON round trip and the numbers worth a dashboard."""

    def to_json(self) -> dict:
        return _plain(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, data: dict) -> "Facts":
        """Build from the manifest's JSON. Keys this version does not know are ignored (an older
        eagle3 reading a newer manifest refuses it earlier, by its schema version)."""
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name not in data:
                continue
            value = data[f.name]
            sub = _NESTED.get((cls.__name__, f.name))
            kwargs[f.name] = sub.from_json(value) if (sub is not None and value is not None) else value
        return cls(**kwargs)

    def complete_note(self, exp_dir) -> str:
        """What the announcement of an already complete run adds after its hash (``StageJob.claim``);
        empty: ``, nothing to do``."""
        return ""

    def metrics(self, prefix: str) -> dict[str, float]:
        """Scalar facts as ``{f"{prefix}/{name}": value}`` (wandb's summary of a stage run)."""
        out = {}
        for k, v in self.to_json().items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v is not None:
                out[f"{prefix}/{k}"] = v
        return out


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


@dataclass
class PrepareFacts(Facts):
    """What prepare promises: a tokenized dataset of this tokenizer, and a draft vocabulary."""

    tokenizer_hash: str                 # the tokenizer's identity (eagle3.target); extract/train refuse another
    max_length: int                     # samples were cut to this many tokens
    draft_vocab_size: int               # rows of the draft's lm_head (d2t / t2d in vocab.safetensors)
    vocab_size: int                     # the target's vocabulary
    coverage: float                     # share of trainable tokens inside the draft vocabulary
    num_train: int                      # samples per split
    num_eval: int
    tokens: int                         # all tokens, both splits
    trainable_tokens: int               # assistant (loss-masked) tokens, both splits
    dropped: dict = field(default_factory=dict)   # reason -> count of conversations left out
    bad_records: int = 0                # malformed source records skipped (data.on_bad_record=skip)
    regenerated: bool = False           # answers written by the target (prepare.regenerate)
    regen: Optional[dict] = None        # the regeneration settings, when regenerated
    # str(n) -> share of trainable (train split) tokens covered by the n most frequent tokens, at
    # eagle3.data.vocab.COVERAGE_SIZES and the chosen draft_vocab_size; None in runs before it existed
    coverage_curve: Optional[dict] = None
    # split -> {category: samples} when the source records carry a `category` (or `domain`) field
    # (the dataset then has a `category` column); None without categories or in runs before them
    categories: Optional[dict] = None
    # prepare.draft_vocab_size=auto (eagle3.data.vocab_choice): {"chosen", "coverage", "score",
    # "runner_up", "default" ({"size", "coverage", "score"} each), "candidates", "multiple",
    # "cost_model"}; None when the size was given
    vocab_choice: Optional[dict] = None

    def metrics(self, prefix: str) -> dict[str, float]:
        out = super().metrics(prefix)
        out.update({f"{prefix}/coverage_top_{n}": v for n, v in (self.coverage_curve or {}).items()})
        if self.vocab_choice:
            out[f"{prefix}/vocab_choice_score"] = self.vocab_choice["score"]
        return out

    def vocab_choice_line(self) -> str:
        """``prepare.draft_vocab_size=auto``'s choice and evidence in one line; empty when the size was given."""
        return vocab_choice_line(self.vocab_choice) if self.vocab_choice else ""

    def coverage_line(self) -> str:
        """The coverage curve in one line for a person (prepare's end, stage=status, stage=plan)."""
        if not self.coverage_curve:
            return f"{self.coverage:.4f} at {self.draft_vocab_size} (no curve recorded: a run before eagle3 recorded it)"
        return ", ".join(f"{_size_label(int(n))}{'*' if int(n) == self.draft_vocab_size else ''} {v:.4f}"
                         for n, v in sorted(self.coverage_curve.items(), key=lambda kv: int(kv[0]))) + \
            " (* = prepare.draft_vocab_size)"


def vocab_choice_line(choice: dict) -> str:
    """A ``PrepareFacts.vocab_choice`` in one line for a person (prepare's end, stage=status, stage=plan)."""
    c = choice["cost_model"]
    ru = choice.get("runner_up")
    d = choice["default"]
    return (f"draft vocabulary auto: {choice['chosen']} (coverage {choice['coverage']:.4f}, score {choice['score']:.4f}) "
            f"maximising coverage / (1 + {c['draft_tokens']} x (draft {c['draft_fixed_flops'] / 1e6:.1f} MFLOP + "
            f"{c['lm_head_flops_per_row']} FLOP x V) / target {c['target_flops'] / 1e6:.1f} MFLOP per token) over "
            f"{choice['candidates']} sizes"
            + (f"; runner-up {ru['size']} (score {ru['score']:.4f})" if ru else "")
            + f"; the default {d['size']}: coverage {d['coverage']:.4f}, score {d['score']:.4f}")


def layer_probe_line(p: dict) -> str:
    """An ``ExtractFacts.layer_probe`` in one line: the choice, its evidence and cost (extract's summary,
    stage=status)."""
    s = p["scores"]
    z = "no spread" if p["z"] is None else f"{p['z']:.1f} s.e."
    verdict = (f"the chosen layers beat the default by {z} (>= {p['min_z']:g})" if not p["kept_default"]
               else f"the default kept: the chosen layers {p['chosen']} differ from it by {z} (< {p['min_z']:g})"
               if p["chosen"] != p["default"] else "the probe chose the default layers")
    return (f"layer probe: layer ids {p['layer_ids']} ({verdict}); held-out score chosen {s['chosen']:.4f}, default "
            f"{p['default']} {s['default']:.4f}, difference {p['difference']:+.4f} +- {p['se']:.4f}; "
            f"{p['samples']} samples, {p['tokens']} tokens, {p['positions']['test']} test positions, "
            f"{p['seconds']['total']:.1f} s ({p['seconds']['forward']:.1f} s the target's forward)"
            + (", reused from its cache" if p.get("reused") else ""))


def _size_label(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


@dataclass
class ExtractFacts(Facts):
    """What extract promises: a complete store of these layers, for every sample of each split."""

    # what every shard holds: the aux layer ids (vLLM's convention: id k = stream entering layer k),
    # the last layer id L (the final pre-norm state, stored beside them), the hidden size, the store
    # dtype (fp8: float8 e4m3 + float32 scales) and the target's identity; its format and bytes per
    # token (hidden states + ids + mask) follow from it (eagle3.store_layout.StoreLayout)
    layout: StoreLayout
    target_dtype: str                   # dtype the target ran in
    backend: str                        # extract.backend that produced the states
    num_samples: dict = field(default_factory=dict)   # split -> samples
    num_tokens: dict = field(default_factory=dict)    # split -> tokens
    # -- the store's checks (eagle3.extract.checks); None in runs recorded before they existed ----
    # split -> {"positions", "agreeing", "rate", "samples"}: how often the stored last state, through
    # the target's final norm and lm_head, predicts the next token at sampled assistant positions
    agreement: Optional[dict] = None
    # the extract.min_agreement the rates were held to (answers regenerated greedily by the target);
    # None when they were only reported (other data, or extract.min_agreement=0)
    agreement_threshold: Optional[float] = None
    # the parity sample against transformers: {"samples", "worst" (layer -> relative error),
    # "worst_sample", "max", "tolerance", "dtype", "reference"}, or {"skipped": why}
    parity: Optional[dict] = None
    # training samples this process took from kept online caches instead of running the target:
    # {"samples": n, "caches": [directories]} (eagle3.extract.reuse.fill_from_caches); None when none
    reused: Optional[dict] = None
    # extract.layer_ids=auto (eagle3.extract.layer_probe): {"layer_ids" (what was extracted), "chosen",
    # "default", "kept_default", "scores" ({"chosen", "default"}: held-out weighted top-1), "difference",
    # "se", "z", "min_z", "greedy", "samples", "tokens", "positions", "seconds", "reused", ...}; None
    # when the ids were given
    layer_probe: Optional[dict] = None

    def metrics(self, prefix: str) -> dict[str, float]:
        out = super().metrics(prefix)
        out.update({f"{prefix}/last_layer_id": self.layout.last_layer_id, f"{prefix}/hidden_size": self.layout.hidden_size,
                    f"{prefix}/bytes_per_token": self.layout.bytes_per_token})
        out.update({f"{prefix}/tokens_{split}": n for split, n in self.num_tokens.items()})
        for split, a in (self.agreement or {}).items():
            if a.get("rate") is not None:
                out[f"{prefix}/agreement_{split}"] = a["rate"]
        if self.parity and self.parity.get("max") is not None:
            out[f"{prefix}/parity_max_rel_error"] = self.parity["max"]
        return out

    def checks_line(self) -> str:
        """The checks in one line for a person (end of extraction, ``stage=status``, export's warning)."""
        parts = []
        splits = sorted(self.agreement or {}, key=lambda s: (s != "train", s != "eval", s))  # JSON sorts keys
        figs = ", ".join(f"{s} {self.agreement[s]['rate']:.4f} ({self.agreement[s]['positions']} positions)"
                         for s in splits if self.agreement[s].get("rate") is not None)
        if figs:
            rule = (f"required >= {self.agreement_threshold:g}: answers regenerated greedily by the target"
                    if self.agreement_threshold else "reported only: answers not regenerated greedily by the target")
            parts.append(f"target agreement {figs} ({rule})")
        p = self.parity or {}
        if p.get("method") == "float32 reference":
            on = f" (the dequantized weights of the {p['quantization']} checkpoint)" if p.get("quantization") else ""
            parts.append(f"parity with transformers in float32{on} on {len(p.get('samples', []))} samples: worst error "
                         f"{p['max']:.2g} of the allowed ({p.get('factor', 0):g}x transformers' own {p.get('dtype')} "
                         f"error, per layer)")
        elif p.get("max") is not None:
            parts.append(f"parity with transformers on {len(p.get('samples', []))} samples: worst relative error "
                         f"{p['max']:.2g} (tolerance {p.get('tolerance', float('nan')):g}, {p.get('dtype')})")
        elif p.get("skipped"):
            parts.append(f"no parity sample ({p['skipped']})")
        if self.agreement is None and self.parity is None:
            parts.append("no checks recorded (a store extracted before eagle3 checked stores)")
        return "; ".join(parts)


@dataclass
class StepMetrics(Facts):
    """The draft's loss and accuracy per TTT step j = 0..S-1 over one window of training or one
    pass over the held-out split. ``accept_len[k-1]`` is the expected acceptance length of a chain
    of k drafted tokens (eagle3.train.metrics.expected_acceptance_lengths)."""

    loss: float             # the objective trained: sum_j decay**j * (CE summed at j) / (loss positions of j)
    loss_per_step: list     # mean CE over step j's scored positions (NaN where none)
    acc_per_step: list      # top-1 agreement with the target at step j (NaN where none)
    cond_acc_per_step: list  # the same where steps 0..j-1 were all right (0 where none)
    accept_len: list        # expected tokens per target step for chains of k = 1..S drafts
    scored_positions: float = 0.0  # positions scored at step 0

    def to_log(self, prefix: str) -> dict[str, float]:
        """The flat names metrics.jsonl, wandb and the notebooks use (``train/acc_step_0``, ...)."""
        rec = {f"{prefix}/loss": self.loss}
        for j in range(len(self.loss_per_step)):
            rec[f"{prefix}/loss_step_{j}"] = self.loss_per_step[j]
            rec[f"{prefix}/acc_step_{j}"] = self.acc_per_step[j]
            rec[f"{prefix}/cond_acc_step_{j}"] = self.cond_acc_per_step[j]
        for k, v in enumerate(self.accept_len, start=1):
            rec[f"{prefix}/accept_len_k{k}"] = v
        rec[f"{prefix}/scored_positions"] = self.scored_positions
        return rec


@dataclass
class TrainFacts(Facts):
    """What train promises: a draft trained on these layers and this vocabulary, and how well it
    predicts (on the held-out split when there is one)."""

    steps: int
    ttt_steps: int
    layer_ids: list
    draft_vocab_size: int
    # the last logged training window; None when a run killed after its last checkpoint resumed
    # at its final step (nothing was left to log)
    train: Optional[StepMetrics] = None
    eval: Optional[StepMetrics] = None  # the last pass over the held-out split, if there is one
    # where the hidden states came from: "store" (the extract run upstream) or "online" (computed
    # while training, train.hidden_states=online); an online run records what the store would:
    # ``producer`` = {target_hash, layer_ids, last_layer_id, hidden_size, dtype (the store dtype),
    # target_dtype, backend, placement (colocated | external), extract (the backend's semantic config)}
    hidden_states: str = "store"
    producer: Optional[dict] = None
    # an online run with a cache (train.online.cache_bytes > 0): the directory that keeps it, which a
    # later extract run of the same states reads instead of running the target
    cache_dir: Optional[str] = None
    # what train.mixed_precision resolved to on the machine that trained: "bf16" | "no" (None: recorded before)
    mixed_precision: Optional[str] = None

    @property
    def final(self) -> Optional[StepMetrics]:
        """Held-out figures when there are any, else the last training window."""
        return self.eval if self.eval is not None else self.train

    def metrics(self, prefix: str) -> dict[str, float]:
        out = {f"{prefix}/steps": self.steps}
        if self.train is not None:
            out.update(self.train.to_log("train"))
        if self.eval is not None:
            out.update(self.eval.to_log("eval"))
        return out


@dataclass
class ExportFacts(Facts):
    """What export promises: a draft directory in ``format`` that serves with these layer ids and
    vocabulary, and (when verified) what vLLM measured serving it."""

    format: str
    layer_ids: list
    draft_vocab_size: int
    vocab_size: int
    dtype: str
    fingerprint: str                    # content hash of the exported files (eagle3.export.outdir)
    model_dir: str                      # relative to the experiment directory
    source: dict = field(default_factory=dict)    # where the draft came from (train run, or export.from)
    exported_to: Optional[str] = None   # export.out_dir, when a copy was published there
    # -- verification in vLLM (export.verify); None when not verified --------------------------
    k: Optional[int] = None
    acceptance_length: Optional[float] = None     # 1 + accepted / drafts at k
    acceptance_per_position: Optional[list] = None
    tokens_per_step: Optional[float] = None       # generated tokens per target forward step at k
    acceptance_by_k: Optional[dict] = None        # str(k) -> acceptance length
    tokens_per_step_by_k: Optional[dict] = None
    acceptance_per_position_by_k: Optional[dict] = None
    vllm: Optional[dict] = None                   # vLLM's raw counters at k
    ngram: Optional[dict] = None                  # prompt lookup at k (the no-training baseline)
    offline: Optional[dict] = None                # the offline evaluator at k (HF target)
    offline_vs_vllm: Optional[float] = None       # relative difference of the two acceptance lengths
    lossless: Optional[bool] = None
    num_prompts: Optional[int] = None
    max_tokens: Optional[int] = None
    hf_greedy_equals_vllm_greedy: Optional[str] = None
    beats_prompt_lookup: Optional[bool] = None
    vllm_version: Optional[str] = None
    train_expected_acceptance_length: Optional[float] = None  # the train stage's estimate at k
    # -- reports (issue 19); None in runs recorded before them --------------------------------------
    lookup_gain: Optional[float] = None           # tokens per target step vs prompt lookup's, at k, minus 1
    lookup_summary: Optional[str] = None          # that comparison (overall and per domain) as a sentence
    # category -> {num_prompts, acceptance_length, acceptance_per_position, tokens_per_step,
    # acceptance_by_k, tokens_per_step_by_k, ngram_tokens_per_step, beats_prompt_lookup, lookup_gain}:
    # vLLM's per-request acceptance over the held-out prompts of each category ("(none)": without one);
    # None when the prompts carry no category
    by_domain: Optional[dict] = None
    domain_counting: Optional[str] = None  # "per request" (vLLM >= 0.32) or "per category batch" (older vLLM)
    # str(temperature) -> {acceptance_by_k, tokens_per_step_by_k, ngram_tokens_per_step,
    # ngram_acceptance_length}: "0" greedy, others vLLM's speculative sampling, request i seeded
    # sampling_seed + i (export.eval_temperatures)
    by_temperature: Optional[dict] = None
    eval_temperatures: Optional[list] = None
    sampling_seed: Optional[int] = None
    # divergences from plain greedy decoding that passed as near-ties (export.tie_margin), per engine
    tie_margin: Optional[float] = None
    near_ties: Optional[dict] = None
    # bucket label ("0-512", "512-2k", ...) -> {min_tokens, max_tokens, num_prompts, mean_prompt_tokens,
    # acceptance_length, acceptance_per_position, tokens_per_step, acceptance_by_k, tokens_per_step_by_k,
    # ngram_tokens_per_step}: vLLM's acceptance over the held-out prompts of each context length
    # (export.context_buckets, eagle3.export.context_length); None in runs recorded before it
    by_context_length: Optional[dict] = None
    context_buckets: Optional[list] = None
    context_counting: Optional[str] = None  # "per request" (vLLM >= 0.32) or "per bucket batch" (older vLLM)

    def complete_note(self, exp_dir) -> str:
        return f": {exp_dir / self.model_dir}"

    def metrics(self, prefix: str) -> dict[str, float]:
        out = super().metrics(prefix)
        for cat, d in (self.by_domain or {}).items():
            for name in ("acceptance_length", "tokens_per_step", "ngram_tokens_per_step", "lookup_gain"):
                if d.get(name) is not None:
                    out[f"{prefix}/domain/{cat}/{name}"] = d[name]
        out.update(context_metrics(self.by_context_length, prefix))
        for t, row in (self.by_temperature or {}).items():
            for kk, v in (row.get("acceptance_by_k") or {}).items():
                out[f"{prefix}/temperature_{t}/acceptance_length_k{kk}"] = v
            if row.get("ngram_tokens_per_step") is not None:
                out[f"{prefix}/temperature_{t}/ngram_tokens_per_step"] = row["ngram_tokens_per_step"]
        return out


@dataclass
class EvalFacts(Facts):
    """``stage=eval``: the offline evaluator alone (HF target, greedy chain decoding)."""

    k: int
    acceptance_length: float
    acceptance_per_position: list
    tokens_per_step: float
    acceptance_by_k: dict
    tokens_per_step_by_k: dict
    num_prompts: int
    max_tokens: int
    source: dict = field(default_factory=dict)
    num_drafts: Optional[int] = None
    num_accepted: Optional[int] = None
    generated_tokens: Optional[int] = None
    target_steps: Optional[int] = None
    decoding: str = "greedy"            # the offline evaluator decodes greedily (export.eval_temperatures: vLLM only)
    # as ExportFacts.by_context_length, from the offline evaluator (no prompt lookup); None before it
    by_context_length: Optional[dict] = None
    context_buckets: Optional[list] = None

    def complete_note(self, exp_dir) -> str:
        return f": acceptance length {self.acceptance_length} at k={self.k}"

    def metrics(self, prefix: str) -> dict[str, float]:
        out = super().metrics(prefix)
        out.update(context_metrics(self.by_context_length, prefix))
        return out


def context_metrics(by_context: Optional[dict], prefix: str) -> dict[str, float]:
    """``{prefix}/context/{bucket}/{name}``: each context-length bucket's figures (wandb's summary)."""
    out = {}
    for label, d in (by_context or {}).items():
        for name in ("acceptance_length", "tokens_per_step", "ngram_tokens_per_step", "num_prompts"):
            if d.get(name) is not None:
                out[f"{prefix}/context/{label}/{name}"] = d[name]
        for kk, v in (d.get("acceptance_by_k") or {}).items():
            out[f"{prefix}/context/{label}/acceptance_length_k{kk}"] = v
    return out


FACTS: dict[str, type[Facts]] = {"prepare": PrepareFacts, "extract": ExtractFacts, "train": TrainFacts,
                                 "export": ExportFacts, "eval": EvalFacts}
_NESTED = {("TrainFacts", "train"): StepMetrics, ("TrainFacts", "eval"): StepMetrics, ("ExtractFacts", "layout"): StoreLayout}


def facts_from_json(stage: str, data: Optional[dict]) -> Optional[Facts]:
    """A stage's facts as recorded in the manifest (None for a run that recorded none: failed or running)."""
    if not data:
        return None
    return FACTS[stage].from_json(data)


_FLAT_LAYOUT = ("layer_ids", "last_layer_id", "hidden_size", "store_dtype", "store_format", "bytes_per_token")


def upgrade_facts(stage: str, data: dict, schema_version: int) -> dict:
    """Facts written by an older manifest schema, in the current one's field names.

    Version 1 recorded the train stage's metrics as flat lists beside each other
    (``eval_acc_per_step``, ``train_accept_len``, ...) and the names of its files. Versions 1 and 2
    recorded the extract stage's store layout as separate fields (``layer_ids``, ``last_layer_id``,
    ``hidden_size``, ``store_dtype``, and the ``store_format`` and ``bytes_per_token`` that follow
    from them; no target identity: "")."""
    if schema_version < 3 and stage == "extract" and data and "layout" not in data:
        layout = {"layer_ids": data["layer_ids"], "last_layer_id": data["last_layer_id"],
                  "hidden_size": data["hidden_size"], "dtype": data["store_dtype"], "target_hash": ""}
        return {"layout": layout, **{k: v for k, v in data.items() if k not in _FLAT_LAYOUT}}
    if schema_version >= 2 or stage != "train" or not data:
        return data
    out = {k: data[k] for k in ("steps", "ttt_steps", "layer_ids", "draft_vocab_size") if k in data}
    for split in ("train", "eval"):
        if data.get(f"{split}_loss") is None and not data.get(f"{split}_loss_per_step"):
            continue
        per_step = data.get(f"{split}_loss_per_step") or []
        out[split] = {"loss": data.get(f"{split}_loss"), "loss_per_step": per_step,
                      "acc_per_step": data.get(f"{split}_acc_per_step") or [],
                      "cond_acc_per_step": data.get(f"{split}_cond_acc_per_step") or [None] * len(per_step),
                      "accept_len": data.get(f"{split}_accept_len") or []}
    return out
