"""Generation in the real vLLM (greedy, or seeded sampling at a temperature), with or without a
speculative method, counting acceptance (overall and per request).

The engine is driven request by request through ``LLMEngine.add_request`` / ``step()`` (what
``LLM.generate`` does inside) so that target steps per request can be counted exactly: every
``step()`` is one target forward pass for each running request, and a request whose token count
grew in a step was verified in it. Acceptance counters come from ``llm.get_metrics()`` (the
``vllm:spec_decode_*`` counters), as differences around the run.
"""
from __future__ import annotations

import logging
from typing import Optional

from .acceptance import AcceptanceStats

log = logging.getLogger("eagle3.export")

_COUNTERS = {"vllm:spec_decode_num_drafts": "num_drafts", "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "num_accepted"}
_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_counters(llm) -> dict:
    out = {v: 0 for v in _COUNTERS.values()}
    out["per_pos"] = []
    for m in llm.get_metrics():
        if m.name in _COUNTERS:
            out[_COUNTERS[m.name]] += int(m.value)
        elif m.name == _PER_POS:
            vals = list(m.values)
            pp = out["per_pos"]
            out["per_pos"] = [(pp[i] if i < len(pp) else 0) + (vals[i] if i < len(vals) else 0)
                              for i in range(max(len(pp), len(vals)))]
    return out


def greedy_params(max_tokens: int, stop_ids, extra_args: Optional[dict] = None):
    from vllm import SamplingParams

    # ignore_eos + explicit stop ids: the same stop rule as the offline evaluator, whatever the
    # tokenizer and generation_config.json say.
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          stop_token_ids=sorted(int(t) for t in stop_ids), detokenize=False, extra_args=extra_args)


def sampling_params(max_tokens: int, stop_ids, temperature: float, seed: int, extra_args: Optional[dict] = None):
    """Greedy at temperature 0, else seeded sampling (vLLM's speculative sampling keeps the target's
    distribution; the tokens differ from plain decoding's, so no token-for-token lossless check).
    ``extra_args``: vLLM's per-request extension arguments (eagle3.export.speculation_length)."""
    from vllm import SamplingParams

    if temperature == 0:
        return greedy_params(max_tokens, stop_ids, extra_args)
    return SamplingParams(temperature=float(temperature), seed=int(seed), max_tokens=max_tokens, ignore_eos=True,
                          stop_token_ids=sorted(int(t) for t in stop_ids), detokenize=False, extra_args=extra_args)


def _request_spec(out, k: int):
    """Per-request acceptance from vLLM's RequestSpecDecodeMetrics (per_request_spec_decode_metrics)."""
    m = getattr(out.outputs[0], "spec_decode_metrics", None)
    if m is None:
        return None
    hist = list(m.histogram)
    return {"drafts": int(sum(hist)), "accepted": int(sum(j * c for j, c in enumerate(hist))),
            "draft_tokens": int(m.num_draft_tokens),
            "accepted_per_pos": [int(sum(hist[p + 1:])) for p in range(k)]}


def _partition(groups, n: int) -> list:
    groups = [sorted(int(i) for i in g) for g in groups]
    flat = sorted(i for g in groups for i in g)
    if flat != list(range(n)) or any(not g for g in groups):
        raise ValueError(f"groups must split the {n} prompts into non-empty parts, each prompt in one: got {groups}")
    return groups


def generate_counted(llm, prompts: list, max_tokens: int, stop_ids, k: int, temperature: float = 0.0,
                     seed: int = 0, groups: Optional[list] = None, variable_k: bool = False) -> AcceptanceStats:
    """Generate for every prompt in one engine (greedily, or sampled at ``temperature`` with request i
    seeded ``seed + i``); outputs and acceptance stats, overall and per request.

    ``groups`` (lists of prompt indices that split the prompts): each group runs as its own batch, one
    after the other, and its acceptance is the engine counters' difference around it, so a group's
    figures are exact where the engine reports no acceptance per request (vLLM < 0.32, no
    ``per_request_spec_decode_metrics``). ``stats.groups`` then holds them; ``subset`` of whole groups
    reads them.

    ``variable_k``: the engine was opened with ``open_engine(variable_k=True)`` and runs these requests
    at ``k`` draft tokens (0: none, plain decoding; checked on its counters)."""
    if groups is None:
        return _generate(llm, list(enumerate(prompts)), len(prompts), max_tokens, stop_ids, k, temperature, seed,
                         variable_k)
    total = AcceptanceStats(k=k, num_prompts=len(prompts), outputs=[None] * len(prompts),
                            per_request=[None] * len(prompts), temperature=float(temperature))
    total.groups = []
    for g in _partition(groups, len(prompts)):
        part = _generate(llm, [(i, prompts[i]) for i in g], len(prompts), max_tokens, stop_ids, k, temperature, seed,
                         variable_k)
        for i in g:
            total.outputs[i], total.per_request[i] = part.outputs[i], part.per_request[i]
        total.generated_tokens += part.generated_tokens
        total.target_steps += part.target_steps
        total.num_drafts += part.num_drafts
        total.num_draft_tokens += part.num_draft_tokens
        total.num_accepted += part.num_accepted
        total.accepted_per_pos = [a + b for a, b in zip(total.accepted_per_pos, part.accepted_per_pos)]
        total.groups.append({"indices": g, "drafts": part.num_drafts, "accepted": part.num_accepted,
                             "draft_tokens": part.num_draft_tokens, "accepted_per_pos": list(part.accepted_per_pos)})
    return total


def _generate(llm, items: list, n: int, max_tokens: int, stop_ids, k: int, temperature: float,
              seed: int, variable_k: bool = False) -> AcceptanceStats:
    """``items``: (prompt index, token ids) run as one batch; the stats' lists have ``n`` entries,
    those of the prompts not in ``items`` left None."""
    engine = llm.llm_engine
    # acceptance counters need disable_log_stats=False; without speculation there is nothing to count,
    # except in an engine of variable k asked for none, whose counters must then stay still
    before = spec_counters(llm) if (k or variable_k) else None
    extra = None
    if variable_k:
        from .speculation_length import K_ARG

        extra = {K_ARG: int(k)}
    index = {}
    for i, p in items:
        rid = f"eagle3-eval-t{temperature:g}-k{k}-{i}"
        index[rid] = i
        engine.add_request(rid, {"prompt_token_ids": [int(t) for t in p]},
                           sampling_params(max_tokens, stop_ids, temperature, seed + i, extra))
    per_request: list = [None] * n
    lengths = [0] * n
    steps = [0] * n
    outputs: list[Optional[list]] = [None] * n
    while engine.has_unfinished_requests():
        for out in engine.step():
            i = index.get(out.request_id)
            if i is None:
                raise RuntimeError(f"vLLM returned an output for unknown request {out.request_id!r}")
            ids = list(out.outputs[0].token_ids)
            if len(ids) > lengths[i]:
                steps[i] += 1
                lengths[i] = len(ids)
            if out.finished:
                outputs[i] = ids
                per_request[i] = _request_spec(out, k) if k else None
    missing = [i for i, _ in items if outputs[i] is None]
    if missing:
        raise RuntimeError(f"vLLM finished without output for prompts {missing[:5]}")
    stats = AcceptanceStats(k=k, num_prompts=len(items), outputs=outputs, temperature=float(temperature))
    stats.generated_tokens = sum(len(outputs[i]) for i, _ in items)
    stats.target_steps = sum(steps[i] for i, _ in items)
    stats.per_request = [None] * n
    for i, _ in items:
        stats.per_request[i] = {"tokens": len(outputs[i]), "steps": steps[i], **(per_request[i] or {})}
    if not k:
        if before is not None:
            after = spec_counters(llm)
            if after["num_drafts"] != before["num_drafts"] or after["num_draft_tokens"] != before["num_draft_tokens"]:
                raise RuntimeError(f"vLLM drafted {after['num_draft_tokens'] - before['num_draft_tokens']} tokens in a "
                                   f"run asked for none ({K_ARG}=0): the engine's scheduler did not take the "
                                   f"requests' number of draft tokens (eagle3.export.speculation_length)")
        return stats
    after = spec_counters(llm)
    stats.num_drafts = after["num_drafts"] - before["num_drafts"]
    stats.num_draft_tokens = after["num_draft_tokens"] - before["num_draft_tokens"]
    stats.num_accepted = after["num_accepted"] - before["num_accepted"]
    pp_before = before["per_pos"] + [0] * k
    stats.accepted_per_pos = [(after["per_pos"][i] if i < len(after["per_pos"]) else 0) - pp_before[i]
                              for i in range(k)]
    return stats


def run_vllm(target_path, prompts: list, max_tokens: int, stop_ids, *, dtype: str, max_model_len: int,
             kv_cache_gb: float = 1.0, speculative_config: Optional[dict] = None,
             gpu_memory_utilization: Optional[float] = None, trust_remote_code: bool = False) -> AcceptanceStats:
    """Build an engine (optionally speculative), generate greedily, shut it down."""
    return run_vllm_temperatures(target_path, prompts, max_tokens, stop_ids, [0.0], dtype=dtype,
                                 max_model_len=max_model_len, kv_cache_gb=kv_cache_gb,
                                 speculative_config=speculative_config,
                                 gpu_memory_utilization=gpu_memory_utilization,
                                 trust_remote_code=trust_remote_code)[0.0]


def per_request_metrics_supported() -> bool:
    """Whether this vLLM reports acceptance per request (``per_request_spec_decode_metrics``, vLLM >= 0.32)."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    return any(f.name == "per_request_spec_decode_metrics" for f in dataclasses.fields(EngineArgs))


def run_vllm_temperatures(target_path, prompts: list, max_tokens: int, stop_ids, temperatures, *, dtype: str,
                          max_model_len: int, kv_cache_gb: float = 1.0, speculative_config: Optional[dict] = None,
                          seed: int = 0, gpu_memory_utilization: Optional[float] = None,
                          groups: Optional[list] = None, trust_remote_code: bool = False) -> dict:
    """One engine (optionally speculative): the prompts at each temperature in turn (0 = greedy, else
    sampled with request i seeded ``seed + i``); {temperature: AcceptanceStats}. A speculative engine
    also reports acceptance per request where this vLLM can (``per_request_metrics_supported``);
    ``groups``: see ``generate_counted``."""
    from ..vllm_engine import shutdown_llm

    llm = open_engine(target_path, dtype=dtype, max_model_len=max_model_len, kv_cache_gb=kv_cache_gb,
                      speculative_config=speculative_config, gpu_memory_utilization=gpu_memory_utilization,
                      trust_remote_code=trust_remote_code)
    try:
        k = int((speculative_config or {}).get("num_speculative_tokens", 0))
        return measure(llm, prompts, max_tokens, stop_ids, temperatures, k, seed=seed, groups=groups)
    finally:
        shutdown_llm(llm)


def dynamic_k_supported() -> bool:
    """Whether this vLLM drafts a number of tokens chosen at run time (dynamic speculative decoding:
    ``speculative_config.num_speculative_tokens_per_batch_size``, vLLM >= 0.25)."""
    import dataclasses

    from vllm.config import SpeculativeConfig

    return any(f.name == "num_speculative_tokens_per_batch_size" for f in dataclasses.fields(SpeculativeConfig))


def open_engine(target_path, *, dtype: str, max_model_len: int, kv_cache_gb: float = 1.0,
                speculative_config: Optional[dict] = None, gpu_memory_utilization: Optional[float] = None,
                trust_remote_code: bool = False, variable_k: bool = False):
    """An engine of the target (optionally speculative) that counts acceptance; release it with
    eagle3.vllm_engine.shutdown_llm. ``variable_k``: each run (``measure(..., variable_k=True)``) drafts
    the k it names, from 0 (plain decoding) to ``speculative_config``'s num_speculative_tokens
    (eagle3.export.speculation_length)."""
    from ..vllm_engine import build_llm

    extra = {"disable_log_stats": False}
    if speculative_config is not None:
        spec = dict(speculative_config)
        if variable_k:
            from ..vllm_engine import import_vllm

            import_vllm()
            if not dynamic_k_supported():
                import vllm

                raise RuntimeError(f"vLLM {vllm.__version__} has no dynamic speculative decoding "
                                   "(num_speculative_tokens_per_batch_size, vLLM >= 0.25), which export.shared_engines "
                                   "needs: set export.shared_engines=false (one engine per k)")
            from .speculation_length import SCHEDULER

            # every batch size at the engine's k; the scheduler then sets the requests' own k
            spec["num_speculative_tokens_per_batch_size"] = [(1, 1, int(spec["num_speculative_tokens"]))]
            extra["scheduler_cls"] = SCHEDULER
        extra["speculative_config"] = spec
        if per_request_metrics_supported():
            extra["per_request_spec_decode_metrics"] = "summary"
    elif variable_k:
        raise ValueError("variable_k needs a speculative_config")
    return build_llm(str(target_path), max_model_len=max_model_len, kv_cache_gb=kv_cache_gb, dtype=dtype,
                     gpu_memory_utilization=gpu_memory_utilization, trust_remote_code=trust_remote_code, **extra)


def measure(llm, prompts: list, max_tokens: int, stop_ids, temperatures, k: int, *, seed: int = 0,
            groups: Optional[list] = None, variable_k: bool = False) -> dict:
    """The prompts at each temperature in turn on an open engine, at ``k`` draft tokens (the engine's
    own k, or with ``variable_k`` any k up to it); {temperature: AcceptanceStats}."""
    return {float(t): generate_counted(llm, prompts, max_tokens, stop_ids, k, temperature=float(t), seed=seed,
                                       groups=groups, variable_k=variable_k)
            for t in temperatures}
