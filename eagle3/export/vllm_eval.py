"""Greedy generation in the real vLLM, with or without a speculative method, counting acceptance.

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


def greedy_params(max_tokens: int, stop_ids):
    from vllm import SamplingParams

    # ignore_eos + explicit stop ids: the same stop rule as the offline evaluator, whatever the
    # tokenizer and generation_config.json say.
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          stop_token_ids=sorted(int(t) for t in stop_ids), detokenize=False)


def generate_counted(llm, prompts: list, max_tokens: int, stop_ids, k: int) -> AcceptanceStats:
    """Generate greedily for every prompt in one engine; outputs and acceptance stats."""
    params = greedy_params(max_tokens, stop_ids)
    engine = llm.llm_engine
    # acceptance counters need disable_log_stats=False; without speculation there is nothing to count
    before = spec_counters(llm) if k else None
    index = {}
    for i, p in enumerate(prompts):
        rid = f"eagle3-eval-{i}"
        index[rid] = i
        engine.add_request(rid, {"prompt_token_ids": [int(t) for t in p]}, params)
    lengths = [0] * len(prompts)
    steps = [0] * len(prompts)
    outputs: list[Optional[list]] = [None] * len(prompts)
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
    missing = [i for i, o in enumerate(outputs) if o is None]
    if missing:
        raise RuntimeError(f"vLLM finished without output for prompts {missing[:5]}")
    stats = AcceptanceStats(k=k, num_prompts=len(prompts), outputs=outputs)
    stats.generated_tokens = sum(len(o) for o in outputs)
    stats.target_steps = sum(steps)
    if not k:
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
             kv_cache_gb: float = 1.0, speculative_config: Optional[dict] = None) -> AcceptanceStats:
    """Build an engine (optionally speculative), generate, shut it down."""
    from ..vllm_engine import build_llm, shutdown_llm

    extra = {"disable_log_stats": False}
    if speculative_config is not None:
        extra["speculative_config"] = dict(speculative_config)
    llm = build_llm(str(target_path), max_model_len=max_model_len, kv_cache_gb=kv_cache_gb, dtype=dtype, **extra)
    try:
        k = int((speculative_config or {}).get("num_speculative_tokens", 0))
        return generate_counted(llm, prompts, max_tokens, stop_ids, k)
    finally:
        shutdown_llm(llm)
