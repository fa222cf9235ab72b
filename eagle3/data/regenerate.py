"""Have the target rewrite every assistant turn (EAGLE-3 trains best on the target's own outputs).

Turn r of every conversation is generated in one batched vLLM call, given the already
regenerated history of turns < r; conversations that end on a user turn get a final answer.
"""
from __future__ import annotations

import logging

log = logging.getLogger("eagle3.regenerate")


def _prompt_ids(tokenizer, messages) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def regenerate(conversations: list[list[dict]], tokenizer, target_path: str, regen_cfg,
               progress: bool = True) -> tuple[list[list[dict]], dict]:
    """Conversations with every assistant turn written by the target, and counts."""
    from tqdm.auto import tqdm

    from ..vllm_engine import build_llm, import_vllm, shutdown_llm

    vllm = import_vllm()
    # The assistant turns to produce: each existing assistant turn, plus one after a final user turn.
    plans = []
    for msgs in conversations:
        slots = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        if msgs and msgs[-1]["role"] == "user":
            slots.append(len(msgs))
        plans.append(slots)
    rounds = max((len(p) for p in plans), default=0)
    # histories[c]: the conversation so far with generated assistant turns; cursors[c]: the next
    # original message to copy over.
    histories = [[] for _ in conversations]
    cursors = [0] * len(conversations)
    params = vllm.SamplingParams(temperature=regen_cfg.temperature, top_p=regen_cfg.top_p,
                                 max_tokens=regen_cfg.max_tokens, seed=regen_cfg.seed)
    max_prompt = regen_cfg.max_model_len - regen_cfg.max_tokens
    llm = build_llm(target_path, max_model_len=regen_cfg.max_model_len, kv_cache_gb=regen_cfg.kv_cache_gb,
                    seed=regen_cfg.seed)
    stats = {"regenerated_turns": 0, "truncated_turns": 0, "dropped_too_long": 0, "empty_response": 0}
    alive = [True] * len(conversations)
    try:
        for r in tqdm(range(rounds), desc="regenerate turns", disable=not progress):
            batch, index = [], []
            for c, (msgs, slots) in enumerate(zip(conversations, plans)):
                if r >= len(slots) or not alive[c]:
                    continue
                upto = slots[r]
                while cursors[c] < upto:
                    histories[c].append(msgs[cursors[c]])
                    cursors[c] += 1
                ids = _prompt_ids(tokenizer, histories[c])
                if len(ids) > max_prompt:
                    alive[c] = False
                    stats["dropped_too_long"] += 1
                    continue
                batch.append({"prompt_token_ids": ids})
                index.append(c)
            if not batch:
                continue
            results = llm.generate(batch, params, use_tqdm=False)
            for c, res in zip(index, results):
                cursors[c] = plans[c][r] + 1  # skip the original assistant turn it replaces
                comp = res.outputs[0]
                if not comp.text.strip():
                    alive[c] = False
                    stats["empty_response"] += 1
                    continue
                histories[c].append({"role": "assistant", "content": comp.text.strip()})
                stats["regenerated_turns"] += 1
                stats["truncated_turns"] += int(comp.finish_reason == "length")
    finally:
        shutdown_llm(llm)
    result = [h for h, ok in zip(histories, alive) if ok]
    log.info("regenerated %d assistant turns (%d hit max_tokens, %d conversations too long)",
             stats["regenerated_turns"], stats["truncated_turns"], stats["dropped_too_long"])
    return result, stats
