"""Acceptance statistics, counted the way vLLM counts them, for both evaluators.

vLLM (``Scheduler.update_from_output`` -> ``SpecDecodingStats.observe_draft``) counts one *draft*
per request per target step that verified draft tokens, with all ``k`` tokens proposed even when
the request is about to reach ``max_tokens``, and counts the accepted ones before the output is
truncated at a stop token or at ``max_tokens``. Mean acceptance length = 1 + accepted / drafts.
The prefill step produces a token without a draft. Prompt lookup (ngram) proposes nothing when it
finds no match, so its acceptance length covers only the steps with a match; generated tokens per
target step (every step of every request, prefill included) compares methods fairly.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AcceptanceStats:
    k: int
    num_prompts: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted: int = 0
    accepted_per_pos: list = field(default_factory=list)
    generated_tokens: int = 0
    target_steps: int = 0
    outputs: list = field(default_factory=list)  # generated token ids per prompt
    # the target's greedy continuations the offline evaluator replayed on (reusable across k)
    continuations: list = field(default_factory=list, repr=False)
    # offline evaluator with check_outputs: per prompt, whether transformers' greedy decoding gives that output
    hf_agrees: list = field(default_factory=list, repr=False)
    # vLLM only, per prompt: {"tokens", "steps"} and, for a speculative engine with per-request
    # metrics, {"drafts", "accepted", "accepted_per_pos"} (vLLM's RequestSpecDecodeMetrics)
    per_request: list = field(default_factory=list, repr=False)
    temperature: float = 0.0  # 0 = greedy; else seeded sampling (vLLM only)
    # vLLM run group by group (generate_counted's groups): per group {"indices", "drafts", "accepted",
    # "draft_tokens", "accepted_per_pos"}, from the engine counters around each group's batch
    groups: list = field(default_factory=list, repr=False)

    def __post_init__(self):
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.k

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_length(self) -> float:
        return 1.0 + self.num_accepted / self.num_drafts if self.num_drafts else float("nan")

    @property
    def per_position(self) -> list:
        return [a / self.num_drafts if self.num_drafts else float("nan") for a in self.accepted_per_pos]

    @property
    def tokens_per_step(self) -> float:
        return self.generated_tokens / self.target_steps if self.target_steps else float("nan")

    def subset(self, indices) -> "AcceptanceStats":
        """The figures of the prompts at ``indices`` alone: from the group counters when ``indices`` are
        whole groups, else from the per-request records (vLLM's); acceptance NaN without either."""
        idx = list(indices)
        reqs = [self.per_request[i] for i in idx]
        sub = AcceptanceStats(k=self.k, num_prompts=len(idx), outputs=[self.outputs[i] for i in idx],
                              per_request=reqs, temperature=self.temperature)
        sub.generated_tokens = sum(r["tokens"] for r in reqs)
        sub.target_steps = sum(r["steps"] for r in reqs)
        whole = [g for g in self.groups if set(g["indices"]) <= set(idx)]
        if self.groups and sorted(i for g in whole for i in g["indices"]) == sorted(idx):
            sub.num_drafts = sum(g["drafts"] for g in whole)  # whole groups: their counters, exact
            sub.num_accepted = sum(g["accepted"] for g in whole)
            sub.num_draft_tokens = sum(g["draft_tokens"] for g in whole)
            sub.accepted_per_pos = [sum(g["accepted_per_pos"][p] for g in whole) for p in range(self.k)]
        elif reqs and all("drafts" in r for r in reqs):
            sub.num_drafts = sum(r["drafts"] for r in reqs)
            sub.num_accepted = sum(r["accepted"] for r in reqs)
            sub.num_draft_tokens = sum(r.get("draft_tokens", 0) for r in reqs)
            sub.accepted_per_pos = [sum(r["accepted_per_pos"][p] for r in reqs) for p in range(self.k)]
        else:
            sub.num_drafts = 0  # no per-request acceptance: acceptance_length is NaN, tokens per step stands
        return sub

    def summary(self) -> dict:
        return {"k": self.k, "acceptance_length": round(self.acceptance_length, 4),
                "acceptance_per_position": [round(p, 4) for p in self.per_position],
                "tokens_per_step": round(self.tokens_per_step, 4), "num_drafts": self.num_drafts,
                "num_accepted": self.num_accepted, "generated_tokens": self.generated_tokens,
                "target_steps": self.target_steps, "num_prompts": self.num_prompts}


def _gain(draft: float, lookup: float) -> float:
    return draft / lookup - 1.0 if lookup else float("nan")


def lookup_verdict(k: int, num_prompts: int, tps: float, lookup_tps: float, by_domain: dict | None = None) -> str:
    """One plain sentence: does the draft beat prompt lookup (ngram, no training) on these prompts, by
    how much (generated tokens per target step, both at k), and per domain."""
    beats = tps > lookup_tps
    head = (f"EAGLE-3 {'beats' if beats else 'does NOT beat'} prompt lookup on these {num_prompts} prompts: "
            f"{tps:.3f} vs {lookup_tps:.3f} tokens per target step at k={k} ({_gain(tps, lookup_tps):+.1%})")
    if not by_domain:
        return head
    parts = []
    for cat, d in by_domain.items():
        a, b = d.get("tokens_per_step"), d.get("ngram_tokens_per_step")
        if a is None or b is None:
            continue
        gain = d["lookup_gain"] if d.get("lookup_gain") is not None else _gain(a, b)
        parts.append(f"{cat} ({d['num_prompts']}) {a:.3f} vs {b:.3f} ({gain:+.1%}"
                     f"{'' if a > b else ', not better'})")
    return head + ("; per domain: " + ", ".join(parts) if parts else "")
