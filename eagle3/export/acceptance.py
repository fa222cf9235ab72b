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

    def summary(self) -> dict:
        return {"k": self.k, "acceptance_length": round(self.acceptance_length, 4),
                "acceptance_per_position": [round(p, 4) for p in self.per_position],
                "tokens_per_step": round(self.tokens_per_step, 4), "num_drafts": self.num_drafts,
                "num_accepted": self.num_accepted, "generated_tokens": self.generated_tokens,
                "target_steps": self.target_steps, "num_prompts": self.num_prompts}
