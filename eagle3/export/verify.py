"""export.verify: prove in the real vLLM that the exported directory serves the trained draft.

1. The files read back are the trained draft: same tensors (in the export dtype), same vocabulary
   mapping and layer ids as the manifest's (catches a writer that renames or drops something).
2. vLLM's plain greedy decoding (in the draft's engine at 0 draft tokens, or an engine without
   speculation), past stop tokens and max_tokens by k + 1: the greedy reference output (cut at the
   first stop token and max_tokens) and the path steps 3 and 6 replay on.
3. The offline PyTorch evaluator runs the trained draft (the manifest's mapping) with the HF target
   on that path: the reference acceptance length; the target's own argmax on the path says whether
   transformers' greedy decoding gives vLLM's outputs (``hf_greedy_equals_vllm_greedy``).
4. vLLM with ``{"method": "eagle3", "model": DIR, "num_speculative_tokens": k}``: a draft vLLM
   refuses to load fails here with vLLM's error; every output must equal step 2's token for token
   (lossless); its acceptance length must agree with step 3 within ``tolerance`` (relative), else
   the served draft computes something else than the trained one (d2t, layer ids, norms, ...).
   A GPU's batched verification and its one-token decoding round differently, so greedy outputs
   can part where the target's two best tokens are all but tied: at each first difference the
   target (transformers, float32) scores both tokens, and a divergence passes only as a near-tie
   (both tokens the target's two best, their logits within ``tie_margin``); any other fails.
5. Each other k in ``eval_ks``: acceptance length (and the lossless check again).
6. Prompt lookup (ngram, k, n-gram 2..4) on the same prompts: the no-training baseline; compared by
   generated tokens per target step (its acceptance length counts only steps with a match). Greedy,
   it is replayed on step 2's path with vLLM's own proposer (eagle3.export.lookup_replay: the served
   figures without an engine start); ``prompt_lookup=served`` (and sampled temperatures) serve it.
7. Per domain, when the prompts carry a category, and per bucket of prompt context length
   (``context_buckets``, eagle3.export.context_length): the figures of 4-6 over each group's prompts,
   from vLLM's per-request acceptance (``per_request_spec_decode_metrics``) in the same engines; a vLLM
   without it (< 0.32) runs each (category, bucket) cell's prompts as a batch of their own in the
   speculative engines and counts each batch exactly (``domain_counting``, ``context_counting`` say which).
8. Each temperature > 0 of ``temperatures``: the same engines (every k, and prompt lookup) sample
   with request i seeded ``seed + i``; acceptance length per k and temperature. Sampled outputs
   differ from plain decoding's by design (speculative sampling keeps the distribution, not the
   tokens), so losslessness is checked greedily only. The offline evaluator is greedy only.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ..model.draft import NORM_OPTIONS
from .acceptance import AcceptanceStats, lookup_verdict
from .checkpoint import DraftCheckpoint
from .context_length import DEFAULT_EDGES, by_context_length, cells, target_max_length
from .errors import VerificationError
from .importers import import_draft

log = logging.getLogger("eagle3.export")


@dataclass
class Verification:
    """What verification measured (steps 2-8), under the field names of
    :class:`eagle3.contracts.ExportFacts` (which records them: ``dataclasses.asdict``)."""

    k: int
    acceptance_length: float                # vLLM, at k
    acceptance_per_position: list
    tokens_per_step: float
    acceptance_by_k: dict                   # str(k) -> ...
    tokens_per_step_by_k: dict
    acceptance_per_position_by_k: dict
    vllm: dict                              # vLLM's counters at k
    ngram: dict                             # prompt lookup at k
    offline: dict                           # the offline evaluator at k (greedy)
    offline_vs_vllm: float                  # relative difference of the two acceptance lengths
    lossless: bool
    num_prompts: int
    max_tokens: int
    hf_greedy_equals_vllm_greedy: str       # "same/prompts"
    beats_prompt_lookup: bool
    vllm_version: str
    lookup_gain: Optional[float]
    eval_temperatures: list
    sampling_seed: int
    by_temperature: dict                    # str(temperature) -> row (_temperature_row)
    lookup_summary: str
    by_domain: Optional[dict] = None        # category -> figures, when the prompts carry categories
    domain_counting: Optional[str] = None   # how: "per request" (vLLM >= 0.32) or "per category batch"
    tie_margin: Optional[float] = None      # the lossless check's near-tie margin, logits
    near_ties: Optional[dict] = None        # engine -> divergences that passed as near-ties
    by_context_length: Optional[dict] = None  # bucket -> figures (eagle3.export.context_length)
    context_buckets: Optional[list] = None  # the bucket edges, tokens
    context_counting: Optional[str] = None  # "per request" (vLLM >= 0.32) or "per bucket batch"


def check_files(model_dir: Path, reference: DraftCheckpoint, target_config: dict, dtype: str,
                marker: Optional[dict] = None) -> None:
    """The exported files hold exactly ``reference`` (cast to ``dtype``); ``marker``: the export
    marker the directory is read with (default: its file)."""
    got = import_draft(model_dir, target_config, marker=marker)
    ref, cfg = reference, reference.config
    if got.config.aux_layer_ids != list(cfg.aux_layer_ids):
        raise VerificationError(f"{model_dir}: its config makes vLLM capture layers {got.config.aux_layer_ids}, the "
                                f"draft was trained on {cfg.aux_layer_ids}")
    if not torch.equal(got.d2t.long(), ref.d2t.long()) or not torch.equal(got.t2d.bool(), ref.t2d.bool()):
        bad = int((got.d2t.long() != ref.d2t.long()).sum()) if got.d2t.shape == ref.d2t.shape else "all"
        raise VerificationError(f"{model_dir}: its d2t/t2d differ from the vocabulary mapping the draft was trained "
                                f"with ({bad} draft ids map elsewhere)")
    for name in ("norm_before_residual", "draft_vocab_size", "hidden_size", "architecture") + NORM_OPTIONS:
        if getattr(got.config, name) != getattr(cfg, name):
            raise VerificationError(f"{model_dir}: {name}={getattr(got.config, name)!r} in the exported config, "
                                    f"{getattr(cfg, name)!r} in the trained draft")
    want = ref.to(getattr(torch, dtype))
    for name, t in want.tensors.items():
        if not torch.equal(got.tensors[name].to(t.dtype), t):
            raise VerificationError(f"{model_dir}: tensor {name} differs from the trained draft's")
    if (got.embed is None) != (want.embed is None) or (
            got.embed is not None and not torch.equal(got.embed.to(want.embed.dtype), want.embed)):
        raise VerificationError(f"{model_dir}: its embed_tokens differs from the one the draft should run with")


def _first_difference(a: list, b: list) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


TIE_MARGIN_FLOAT32 = 0.05
TIE_MARGIN_HALF = 0.5


def tie_margin_for(target_dtype: str, tie_margin: float = 0.0) -> float:
    """The logit gap under which two tokens count as tied: ``tie_margin`` when set (> 0), else by the
    dtype the target is served in (float32 rounds ~1e-3 of a logit apart, bf16/fp16 ~1e-1)."""
    if tie_margin > 0:
        return float(tie_margin)
    return TIE_MARGIN_FLOAT32 if target_dtype == "float32" else TIE_MARGIN_HALF


class ReferenceScorer:
    """Scores the two tokens where a speculative and a plain greedy output part (for
    :func:`check_lossless`) with the target in transformers (float32). The target is loaded only when
    there is something to score and freed right after: the next vLLM engine sizes its KV cache from
    the device's free memory."""

    def __init__(self, target_path, prompts: list, device: str = "auto", trust_remote_code: bool = False):
        self.target_path, self.prompts, self.device = target_path, prompts, device
        self.trust_remote_code = trust_remote_code

    def gaps(self, spec_outputs: list, plain_outputs: list, bad: list) -> list[dict]:
        """Per prompt in ``bad``: where the outputs part, both tokens, the target's logit gap between
        them and each one's rank (0 = the target's best) given the prompt and the common prefix."""
        from transformers import AutoModelForCausalLM

        dev = self.device if self.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        model = AutoModelForCausalLM.from_pretrained(str(self.target_path), dtype=torch.float32,
                                                     trust_remote_code=self.trust_remote_code).to(dev).eval()
        rows = []
        try:
            for i in bad:
                j = _first_difference(spec_outputs[i], plain_outputs[i])
                row = {"prompt": i, "token": j}
                if j >= min(len(spec_outputs[i]), len(plain_outputs[i])):  # one stopped earlier: nothing to score
                    rows.append({**row, "gap": None, "ranks": None})
                    continue
                a, b = int(plain_outputs[i][j]), int(spec_outputs[i][j])
                with torch.inference_mode():
                    x = torch.tensor([list(self.prompts[i]) + list(plain_outputs[i][:j])], device=model.device)
                    logits = model(input_ids=x).logits[0, -1].float().cpu()
                ranks = [int((logits > logits[t]).sum()) for t in (a, b)]
                rows.append({**row, "plain": a, "speculative": b,
                             "gap": round(abs(float(logits[a] - logits[b])), 6), "ranks": ranks})
        finally:
            del model
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        return rows


def check_lossless(spec: AcceptanceStats, plain: AcceptanceStats, what: str, scorer: ReferenceScorer | None = None,
                   margin: float = TIE_MARGIN_FLOAT32) -> list[dict]:
    """Raise unless ``spec``'s greedy outputs equal ``plain``'s; with a ``scorer``, divergences at
    near-ties (both tokens the target's two best, within ``margin`` logits) pass and are returned."""
    bad = [i for i, (x, y) in enumerate(zip(spec.outputs, plain.outputs)) if x != y]
    if not bad:
        return []
    i = bad[0]
    j = _first_difference(spec.outputs[i], plain.outputs[i])
    head = (f"{what} is not lossless: on {len(bad)} of {len(plain.outputs)} prompts the greedy output differs from "
            f"plain greedy decoding; first at prompt {i}, token {j}: {spec.outputs[i][j:j + 5]} instead of "
            f"{plain.outputs[i][j:j + 5]}")
    if scorer is None:
        raise VerificationError(head)
    rows = scorer.gaps(spec.outputs, plain.outputs, bad)
    real = [r for r in rows if r["gap"] is None or r["gap"] > margin or max(r["ranks"]) > 1]
    if real:
        r = real[0]
        why = ("one output stops where the other goes on" if r["gap"] is None else
               f"the target (transformers, float32) ranks the tokens {r['ranks'][0]} and {r['ranks'][1]} "
               f"(0 = its best) and puts them {r['gap']:.4f} logits apart")
        raise VerificationError(
            f"{head}. At prompt {r['prompt']}, token {r['token']}, {why}: not a near-tie of its two best tokens "
            f"within {margin:g} logits (export.tie_margin), so the served draft changed the target's output. "
            f"{len(real)} of the {len(bad)} divergences are of this kind.")
    log.warning("verify: %s: %d of %d greedy outputs part from plain decoding, each at a near-tie of the target's "
                "two best tokens (logit gaps %s <= %g): rounding of batched verification, counted as lossless",
                what, len(rows), len(plain.outputs), ", ".join(f"{r['gap']:.4f}" for r in rows), margin)
    return rows


def verify_export(model_dir, *, target_path, target_config: dict, target_dtype: str, reference: DraftCheckpoint,
                  prompts: list, k: int, eval_ks, max_tokens: int, stop_ids, kv_cache_gb: float = 1.0,
                  gpu_memory_utilization: float | None = None, tolerance: float = 0.05, device: str = "auto", progress: bool = False,
                  static_check: bool = True, categories: list | None = None, temperatures=(0.0,),
                  seed: int = 0, marker: Optional[dict] = None, tie_margin: float = 0.0,
                  trust_remote_code: bool = False, shared_engines: bool = True,
                  context_buckets=DEFAULT_EDGES, prompt_lookup: str = "auto") -> Verification:
    """Run steps 1-8; returns what they measured; raises VerificationError on any failure.
    ``categories``: each prompt's category (None without one), parallel to ``prompts``; ``marker``:
    the export marker step 1 reads the directory with (default: its file); ``trust_remote_code``:
    target.trust_remote_code, for every engine and model that loads the target; ``shared_engines``
    (export.shared_engines): the draft's engine decodes plainly at 0 draft tokens, then runs every k
    (eagle3.export.speculation_length), else one engine per k and one for plain decoding;
    ``prompt_lookup`` (export.prompt_lookup): replay (on the plain greedy path with vLLM's own proposer,
    eagle3.export.lookup_replay: no engine), served (an engine of its own), auto (replay when greedy only)."""
    import vllm

    from ..vllm_engine import shutdown_llm
    from .lookup_replay import LOOKUP_MAX, LOOKUP_MIN, lookup_mode, reference_outputs, replay_prompt_lookup
    from .offline_eval import offline_acceptance
    from .vllm_eval import measure, open_engine, per_request_metrics_supported, run_vllm, run_vllm_temperatures

    model_dir = Path(model_dir)
    if static_check:
        check_files(model_dir, reference, target_config, target_dtype, marker=marker)
    ks = [k] + sorted({int(x) for x in eval_ks} - {k})
    temps = [0.0] + sorted({float(t) for t in temperatures} - {0.0})
    if categories is not None and len(categories) != len(prompts):
        raise ValueError(f"{len(categories)} categories for {len(prompts)} prompts")
    max_model_len = max(len(p) for p in prompts) + max_tokens + max(ks) + 8
    run = dict(dtype=target_dtype, max_model_len=max_model_len, kv_cache_gb=kv_cache_gb,
               gpu_memory_utilization=gpu_memory_utilization, trust_remote_code=trust_remote_code)
    edges = [int(e) for e in context_buckets]
    max_len = target_max_length(target_config)
    lengths = [len(p) for p in prompts]
    has_categories = categories is not None and any(c is not None for c in categories)
    domain_counting, groups = None, None
    if per_request_metrics_supported():
        context_counting = "per request"
    else:
        # vLLM < 0.32 counts acceptance per engine only: each (category, context bucket) cell's prompts run as a
        # batch of their own in the speculative engines, and its figures are the counters' difference around it
        context_counting = "per bucket batch"
        groups = cells(categories if has_categories else None, lengths, edges, max_len)
        log.info("verify: vLLM %s reports no acceptance per request (per_request_spec_decode_metrics, vLLM >= "
                 "0.32): the speculative engines run each of the %d (category, context length) cells' prompts as a "
                 "batch of its own, so the per-domain and per-length figures are exact engine counts",
                 vllm.__version__, len(groups))
    if has_categories:
        domain_counting = "per request" if groups is None else "per category batch"
    run_spec = dict(run, groups=groups) if groups is not None else run

    lookup = lookup_mode(prompt_lookup, temps)
    # vLLM's plain greedy decoding, past stop tokens and max_tokens by the most draft tokens + 1: the
    # reference of the lossless checks (cut at the first stop token and max_tokens), and the path the offline
    # evaluator and prompt lookup's replay run on (a round that crosses a stop token or max_tokens still has all
    # its drafts verified)
    path_tokens = max_tokens + max(ks) + 1
    scorer = ReferenceScorer(target_path, prompts, device, trust_remote_code=trust_remote_code)
    margin = tie_margin_for(target_dtype, tie_margin)
    near_ties: dict[str, list] = {}
    ngram_cfg = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": LOOKUP_MIN,
                 "prompt_lookup_max": LOOKUP_MAX}
    ngram_runs = None

    def refused(spec_cfg, e):  # vLLM's own error, whatever its type, is the message the user needs
        msg = str(e).strip().splitlines()
        return VerificationError(f"vLLM refused to load the exported draft {model_dir} with "
                                 f"speculative_config={spec_cfg}: {type(e).__name__}: "
                                 f"{' | '.join(msg[-6:]) if msg else repr(e)}")

    runs_by_k: list = []
    if shared_engines:
        # the draft's engine decodes plainly at 0 draft tokens (the reference path), then runs every k of eval_ks
        # in turn; prompt lookup is replayed on the path, or served in a second engine (plain decoding holds no draft)
        spec_cfg = {"method": "eagle3", "model": str(model_dir), "num_speculative_tokens": max(ks)}
        try:
            engine = open_engine(target_path, speculative_config=spec_cfg, variable_k=True, **run)
        except Exception as e:
            raise refused(spec_cfg, e) from e
        try:
            path = measure(engine, prompts, path_tokens, (), [0.0], 0, variable_k=True)[0.0]
            for kk in ks:
                try:
                    runs_by_k.append((kk, measure(engine, prompts, max_tokens, stop_ids, temps, kk, seed=seed,
                                                  groups=groups, variable_k=True)))
                except Exception as e:
                    raise refused({**spec_cfg, "num_speculative_tokens": kk}, e) from e
        finally:
            shutdown_llm(engine)
        if lookup == "served":
            engine = open_engine(target_path, speculative_config=ngram_cfg, variable_k=True, **run)
            try:
                ngram_runs = measure(engine, prompts, max_tokens, stop_ids, temps, k, seed=seed, groups=groups,
                                     variable_k=True)
            finally:
                shutdown_llm(engine)
    else:
        path = run_vllm(target_path, prompts, path_tokens, (), **run)
        for kk in ks:
            spec_cfg = {"method": "eagle3", "model": str(model_dir), "num_speculative_tokens": kk}
            try:
                runs_by_k.append((kk, run_vllm_temperatures(target_path, prompts, max_tokens, stop_ids, temps,
                                                            speculative_config=spec_cfg, seed=seed, **run_spec)))
            except Exception as e:
                raise refused(spec_cfg, e) from e
        if lookup == "served":
            ngram_runs = run_vllm_temperatures(target_path, prompts, max_tokens, stop_ids, temps, seed=seed,
                                               speculative_config=ngram_cfg, **run_spec)
    plain = AcceptanceStats(k=0, num_prompts=len(prompts), outputs=reference_outputs(path.outputs, max_tokens, stop_ids))
    # no engine alive from here: the offline evaluator and the reference scorer load the target in transformers
    offline = offline_acceptance(target_path, reference, prompts, k, max_tokens, stop_ids, dtype=target_dtype,
                                 device=device, progress=progress, trust_remote_code=trust_remote_code,
                                 continuations=path.outputs, check_outputs=plain.outputs)
    log.info("verify: offline evaluator (trained draft, HF target, on vLLM's greedy path), k=%d: acceptance length "
             "%.3f", k, offline.acceptance_length)
    by_k: dict[int, AcceptanceStats] = {}
    sampled: dict[float, dict[int, AcceptanceStats]] = {t: {} for t in temps[1:]}
    for kk, runs in runs_by_k:
        stats = runs[0.0]
        if ties := check_lossless(stats, plain, f"EAGLE-3 with k={kk} in vLLM", scorer, margin):
            near_ties[f"eagle3 k={kk}"] = ties
        by_k[kk] = stats
        for t in temps[1:]:
            sampled[t][kk] = runs[t]
            log.info("verify: vLLM k=%d at temperature %g (seeded): acceptance length %.3f", kk, t,
                     runs[t].acceptance_length)
        log.info("verify: vLLM k=%d: acceptance length %.3f, per position %s, %.3f tokens per target step", kk,
                 stats.acceptance_length, [round(p, 3) for p in stats.per_position], stats.tokens_per_step)
    main = by_k[k]
    rel = abs(main.acceptance_length - offline.acceptance_length) / offline.acceptance_length
    if not math.isfinite(rel) or rel > tolerance:
        raise VerificationError(
            f"vLLM's acceptance length {main.acceptance_length:.3f} (k={k}) differs by {rel:.1%} from the offline "
            f"evaluator's {offline.acceptance_length:.3f} for the trained draft on the same {len(prompts)} prompts "
            f"(tolerance {tolerance:.0%}): the exported draft does not compute what was trained. Check the "
            f"vocabulary mapping (d2t), the aux layer ids and norm_before_residual in {model_dir}/config.json.")
    if ngram_runs is None:  # replayed on the path with vLLM's own proposer: greedy only (lookup_mode)
        ngram_runs = {0.0: replay_prompt_lookup(prompts, path.outputs, k, max_tokens, stop_ids, min_n=LOOKUP_MIN,
                                                max_n=LOOKUP_MAX, max_model_len=max_model_len)}
    ngram = ngram_runs[0.0]
    if ties := check_lossless(ngram, plain, f"prompt lookup with k={k} in vLLM", scorer, margin):
        near_ties[f"ngram k={k}"] = ties
    log.info("verify: prompt lookup k=%d (%s): %.3f tokens per target step", k,
             "served" if lookup == "served" else "replayed with vLLM's proposer on the greedy path",
             ngram.tokens_per_step)
    same_hf = sum(offline.hf_agrees)
    domains = None
    if groups is None:
        for kk, stats in [*by_k.items(), (0, ngram)]:
            _check_per_request_totals(stats, "prompt lookup" if kk == 0 else f"EAGLE-3 k={kk}")
    if domain_counting is not None:
        domains = by_domain(categories, by_k, k, ngram)
    contexts = by_context_length(lengths, edges, max_len, by_k, k, ngram)
    result = Verification(
        k=k, acceptance_length=round(main.acceptance_length, 4),
        acceptance_per_position=[round(p, 4) for p in main.per_position],
        tokens_per_step=round(main.tokens_per_step, 4),
        acceptance_by_k={str(kk): round(s.acceptance_length, 4) for kk, s in by_k.items()},
        tokens_per_step_by_k={str(kk): round(s.tokens_per_step, 4) for kk, s in by_k.items()},
        acceptance_per_position_by_k={str(kk): [round(p, 4) for p in s.per_position] for kk, s in by_k.items()},
        # the offline evaluator decodes greedily, whatever the temperatures
        vllm=main.summary(), ngram=ngram.summary(), offline={**offline.summary(), "decoding": "greedy"},
        offline_vs_vllm=round(rel, 5), lossless=True, num_prompts=len(prompts), max_tokens=max_tokens,
        hf_greedy_equals_vllm_greedy=f"{same_hf}/{len(prompts)}",
        beats_prompt_lookup=main.tokens_per_step > ngram.tokens_per_step, vllm_version=vllm.__version__,
        lookup_gain=round(main.tokens_per_step / ngram.tokens_per_step - 1, 4) if ngram.tokens_per_step else None,
        eval_temperatures=temps, sampling_seed=seed,
        by_temperature={f"{t:g}": _temperature_row(by_k if t == 0 else sampled[t], ngram_runs[t]) for t in temps},
        lookup_summary=lookup_verdict(k, len(prompts), main.tokens_per_step, ngram.tokens_per_step, domains),
        by_domain=domains, domain_counting=domain_counting, tie_margin=margin, near_ties=near_ties,
        by_context_length=contexts, context_buckets=edges, context_counting=context_counting)
    if not result.beats_prompt_lookup:
        log.warning("verify: the draft makes %.3f tokens per target step, prompt lookup %.3f: no better than the "
                    "no-training baseline on these prompts", main.tokens_per_step, ngram.tokens_per_step)
    return result


def _temperature_row(by_k: dict, ngram: AcceptanceStats) -> dict:
    """Acceptance length and tokens per target step per k at one temperature, and prompt lookup's."""
    return {"acceptance_by_k": {str(kk): round(s.acceptance_length, 4) for kk, s in by_k.items()},
            "tokens_per_step_by_k": {str(kk): round(s.tokens_per_step, 4) for kk, s in by_k.items()},
            "ngram_tokens_per_step": round(ngram.tokens_per_step, 4),
            "ngram_acceptance_length": round(ngram.acceptance_length, 4)}


def _check_per_request_totals(stats: AcceptanceStats, what: str) -> None:
    """vLLM's per-request acceptance must add up to its engine counters, else per-domain figures lie."""
    reqs = stats.per_request
    if not reqs or any("drafts" not in r for r in reqs):
        raise VerificationError(f"{what}: vLLM returned no per-request acceptance for some prompts "
                                f"(per_request_spec_decode_metrics); per-domain and per-context-length figures "
                                f"cannot be computed")
    drafts, accepted = sum(r["drafts"] for r in reqs), sum(r["accepted"] for r in reqs)
    if (drafts, accepted) != (stats.num_drafts, stats.num_accepted):
        raise VerificationError(f"{what}: vLLM's per-request acceptance ({accepted} accepted of {drafts} drafts) "
                                f"does not add up to its counters ({stats.num_accepted} of {stats.num_drafts})")


def category_indices(categories: list) -> dict:
    """Category (``(none)`` for prompts without one) -> the indices of its prompts, categories sorted."""
    groups: dict = {}
    for i, c in enumerate(categories):
        groups.setdefault("(none)" if c is None else str(c), []).append(i)
    return {c: groups[c] for c in sorted(groups)}


def by_domain(categories: list, by_k: dict, k: int, ngram: AcceptanceStats) -> dict:
    """Per category (``(none)`` for prompts without one): prompts, vLLM's acceptance length and tokens
    per target step per k, prompt lookup's at k, and whether the draft beats it there."""
    out = {}
    for cat, idx in category_indices(categories).items():
        subs = {kk: s.subset(idx) for kk, s in by_k.items()}
        ng = ngram.subset(idx)
        main = subs[k]
        out[cat] = {"num_prompts": len(idx), "acceptance_length": round(main.acceptance_length, 4),
                    "acceptance_per_position": [round(p, 4) for p in main.per_position],
                    "tokens_per_step": round(main.tokens_per_step, 4),
                    "acceptance_by_k": {str(kk): round(s.acceptance_length, 4) for kk, s in subs.items()},
                    "tokens_per_step_by_k": {str(kk): round(s.tokens_per_step, 4) for kk, s in subs.items()},
                    "ngram_tokens_per_step": round(ng.tokens_per_step, 4),
                    "beats_prompt_lookup": main.tokens_per_step > ng.tokens_per_step,
                    "lookup_gain": round(main.tokens_per_step / ng.tokens_per_step - 1, 4) if ng.tokens_per_step else None}
    return out
