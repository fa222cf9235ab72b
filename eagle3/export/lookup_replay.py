"""Prompt lookup (vLLM's ``ngram`` method) replayed on the target's greedy path with vLLM's own proposer.

With greedy verification every output token is the target's greedy token whatever was proposed, so a
greedy run of prompt lookup is fixed by the plain greedy continuation of each prompt: after every
target step vLLM's ngram proposer looks at the request's tokens (prompt and output so far) and proposes
up to k tokens (none without a match); the target accepts them while they equal the continuation and
adds its own next token. This replays those steps, calling the function vLLM's proposer calls
(``vllm.v1.spec_decode.ngram_proposer._find_longest_matched_ngram_and_propose_tokens``), and counts
them the way vLLM's scheduler counts a draft (eagle3.export.acceptance). The figures are the served
engine's (tests/test_export.py serves prompt lookup beside it) without an engine start of its own:
export verification then needs one engine, the draft's (``export.prompt_lookup``).

Greedy only: a sampled run's tokens depend on the proposals, so ``export.eval_temperatures`` above 0
serve prompt lookup in an engine (``export.prompt_lookup=auto`` does that).
"""
from __future__ import annotations

from .acceptance import AcceptanceStats

# prompt lookup's n-gram sizes (vLLM's prompt_lookup_min / prompt_lookup_max)
LOOKUP_MIN, LOOKUP_MAX = 2, 4
LOOKUP_MODES = ("auto", "replay", "served")


def lookup_mode(setting: str, temperatures) -> str:
    """export.prompt_lookup resolved: ``replay`` or ``served``. Replay is greedy only."""
    if setting not in LOOKUP_MODES:
        raise ValueError(f"export.prompt_lookup must be one of {list(LOOKUP_MODES)}, got {setting!r}")
    sampled = [float(t) for t in temperatures if float(t) > 0]
    if setting == "replay" and sampled:
        raise ValueError(f"export.prompt_lookup=replay replays greedy decoding only, and export.eval_temperatures "
                         f"asks for sampled runs at {sampled}: set export.prompt_lookup=served (or auto, which serves "
                         f"prompt lookup in an engine when a temperature is above 0)")
    if setting == "auto":
        return "served" if sampled else "replay"
    return setting


def vllm_ngram_proposer():
    """vLLM's ngram matching function, or an error that says what to set instead."""
    try:
        from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as propose
    except ImportError as e:
        import vllm

        raise RuntimeError(f"vLLM {vllm.__version__} has no ngram proposer function to replay prompt lookup with "
                           f"({e}); set export.prompt_lookup=served (prompt lookup in an engine of its own)") from e
    return propose


def replay_prompt_lookup(prompts: list, paths: list, k: int, max_tokens: int, stop_ids, *, min_n: int, max_n: int,
                         max_model_len: int) -> AcceptanceStats:
    """Greedy prompt lookup at ``k`` on each prompt, replayed on ``paths`` (the target's greedy
    continuation of each prompt, ignoring stop tokens, at least ``max_tokens + k`` long). Outputs stop
    at the first stop token or at ``max_tokens``, as vLLM's do; per-request figures as vLLM reports them."""
    import numpy as np

    propose = vllm_ngram_proposer()
    stops = set(int(t) for t in stop_ids)
    stats = AcceptanceStats(k=k, num_prompts=len(prompts))
    stats.per_request = []
    for prompt, path in zip(prompts, paths):
        path = [int(t) for t in path]
        if len(path) < max_tokens + k:
            raise ValueError(f"a greedy path of {len(path)} tokens cannot replay {max_tokens} tokens at k={k}: it needs "
                             f"{max_tokens + k}")
        tokens = np.zeros(len(prompt) + len(path), dtype=np.int32)  # vLLM's token_ids_cpu rows are int32
        tokens[: len(prompt)] = prompt
        tokens[len(prompt):] = path
        req = {"tokens": 0, "steps": 0, "drafts": 0, "accepted": 0, "draft_tokens": 0, "accepted_per_pos": [0] * k}
        n = 1  # the prefill step's token
        req["steps"] = 1
        done = path[0] in stops or n >= max_tokens
        while not done:
            draft = propose(tokens[: len(prompt) + n], min_n, max_n, max_model_len, k)
            a = 0
            if len(draft):
                while a < len(draft) and int(draft[a]) == path[n + a]:
                    a += 1
                stats.observe(len(draft), a)
                req["drafts"] += 1
                req["draft_tokens"] += len(draft)
                req["accepted"] += a
                for p in range(a):
                    req["accepted_per_pos"][p] += 1
            req["steps"] += 1
            for t in path[n: n + a + 1]:
                n += 1
                if t in stops or n >= max_tokens:
                    done = True
                    break
        out = path[:n]
        req["tokens"] = n
        stats.outputs.append(out)
        stats.per_request.append(req)
        stats.generated_tokens += n
        stats.target_steps += req["steps"]
    return stats


def reference_outputs(paths: list, max_tokens: int, stop_ids) -> list:
    """Plain greedy decoding's outputs from greedy paths that ignored stop tokens: each cut after its
    first stop token, at most ``max_tokens`` long."""
    stops = set(int(t) for t in stop_ids)
    outs = []
    for path in paths:
        out = []
        for t in path[:max_tokens]:
            out.append(int(t))
            if int(t) in stops:
                break
        outs.append(out)
    return outs
