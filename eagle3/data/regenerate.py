"""Have the target rewrite every assistant turn (EAGLE-3 trains best on the target's own outputs).

Turn r of every conversation is generated in one batched call, given the already regenerated
history of turns < r; conversations that end on a user turn get a final answer. Two backends
(``prepare.regen.backend``): vLLM (the default) and transformers' ``generate`` (batched, left
padded), for a machine that has torch but no vLLM.
"""
from __future__ import annotations

import logging

log = logging.getLogger("eagle3.regenerate")


def regenerate(conversations: list[list[dict]], tokenizer, target_path: str, regen_cfg,
               progress: bool = True, dtype: str = "float32", kept: list | None = None,
               trust_remote_code: bool = False) -> tuple[list[list[dict]], dict]:
    """Conversations with every assistant turn written by the target (run in ``dtype``), and counts.
    ``kept``: a list to receive the input index of each returned conversation (some are dropped);
    ``trust_remote_code``: target.trust_remote_code, for the engine or model that loads the target."""
    from tqdm.auto import tqdm

    from .chat_template import generation_prompt_ids

    # The assistant turns to produce: each existing assistant turn, plus one after a final user turn.
    turn_slots = []
    for msgs in conversations:
        slots = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        if msgs and msgs[-1]["role"] == "user":
            slots.append(len(msgs))
        turn_slots.append(slots)
    rounds = max((len(p) for p in turn_slots), default=0)
    # histories[c]: the conversation so far with generated assistant turns; cursors[c]: the next
    # original message to copy over.
    histories = [[] for _ in conversations]
    cursors = [0] * len(conversations)
    max_prompt = regen_cfg.max_model_len - regen_cfg.max_tokens
    generator = (_HFGenerator if regen_cfg.backend == "hf" else _VLLMGenerator)(target_path, tokenizer, regen_cfg,
                                                                                progress, dtype, trust_remote_code)
    stats = {"regenerated_turns": 0, "truncated_turns": 0, "dropped_too_long": 0, "empty_response": 0}
    alive = [True] * len(conversations)
    try:
        for r in tqdm(range(rounds), desc="regenerate turns", disable=not progress):
            batch, index = [], []
            for c, (msgs, slots) in enumerate(zip(conversations, turn_slots)):
                if r >= len(slots) or not alive[c]:
                    continue
                upto = slots[r]
                while cursors[c] < upto:
                    histories[c].append(msgs[cursors[c]])
                    cursors[c] += 1
                ids = generation_prompt_ids(tokenizer, histories[c])
                if len(ids) > max_prompt:
                    alive[c] = False
                    stats["dropped_too_long"] += 1
                    continue
                batch.append(ids)
                index.append(c)
            if not batch:
                continue
            for c, (text, truncated) in zip(index, generator.generate(batch)):
                cursors[c] = turn_slots[c][r] + 1  # skip the original assistant turn it replaces
                if not text.strip():
                    alive[c] = False
                    stats["empty_response"] += 1
                    continue
                histories[c].append({"role": "assistant", "content": text.strip()})
                stats["regenerated_turns"] += 1
                stats["truncated_turns"] += int(truncated)
    finally:
        generator.close()
    result = [h for h, ok in zip(histories, alive) if ok]
    if kept is not None:
        kept.extend(i for i, ok in enumerate(alive) if ok)
    log.info("regenerated %d assistant turns (%d hit max_tokens, %d conversations too long)",
             stats["regenerated_turns"], stats["truncated_turns"], stats["dropped_too_long"])
    return result, stats


class _VLLMGenerator:
    def __init__(self, target_path: str, tokenizer, regen_cfg, progress: bool, dtype: str, trust_remote_code: bool):
        from ..vllm_engine import build_llm, import_vllm

        vllm = import_vllm()
        self.params = vllm.SamplingParams(temperature=regen_cfg.temperature, top_p=regen_cfg.top_p,
                                          max_tokens=regen_cfg.max_tokens, seed=regen_cfg.seed)
        # work="batch": every conversation's next turn decodes at once, hundreds of rows per step, which two
        # threads run ~1.5x faster than one on an idle 2-core machine while the 8-row decode probe hardly moves
        self.llm = build_llm(target_path, max_model_len=regen_cfg.max_model_len, kv_cache_gb=regen_cfg.kv_cache_gb,
                             seed=regen_cfg.seed, dtype=dtype, trust_remote_code=trust_remote_code, work="batch",
                             gpu_memory_utilization=getattr(regen_cfg, "gpu_memory_utilization", None))

    def generate(self, prompts: list[list[int]]) -> list[tuple[str, bool]]:
        """(text, hit max_tokens) per prompt, in order."""
        results = self.llm.generate([{"prompt_token_ids": ids} for ids in prompts], self.params, use_tqdm=False)
        return [(res.outputs[0].text, res.outputs[0].finish_reason == "length") for res in results]

    def close(self) -> None:
        from ..vllm_engine import shutdown_llm

        shutdown_llm(self.llm)


class _HFGenerator:
    """transformers ``generate`` in batches of similar prompt length (left padded), on the GPU if
    there is one. Greedy when temperature is 0, else sampling with a seeded torch generator."""

    def __init__(self, target_path: str, tokenizer, regen_cfg, progress: bool, dtype: str, trust_remote_code: bool):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.cfg = regen_cfg
        self.progress = progress
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = AutoModelForCausalLM.from_pretrained(target_path, dtype=getattr(torch, dtype),
                                                          trust_remote_code=trust_remote_code).to(self.device).eval()
        self.tokenizer = tokenizer
        gen = self.model.generation_config
        eos = gen.eos_token_id if gen.eos_token_id is not None else tokenizer.eos_token_id
        self.eos = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}
        if not self.eos:
            raise ValueError(f"{target_path} names no end-of-sequence token (generation_config.json or the "
                             f"tokenizer): regeneration would always run to prepare.regen.max_tokens")
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos)
        self.pad = pad
        torch.manual_seed(regen_cfg.seed)

    def generate(self, prompts: list[list[int]]) -> list[tuple[str, bool]]:
        from tqdm.auto import tqdm

        torch = self.torch
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        out: list = [None] * len(prompts)
        bs = self.cfg.hf_batch_size
        sample = self.cfg.temperature > 0
        for start in tqdm(range(0, len(order), bs), desc="regenerate (transformers)", leave=False,
                          disable=not self.progress):
            idx = order[start:start + bs]
            width = max(len(prompts[i]) for i in idx)
            ids = torch.full((len(idx), width), self.pad, dtype=torch.long)
            attn = torch.zeros((len(idx), width), dtype=torch.long)
            for r, i in enumerate(idx):
                p = prompts[i]
                ids[r, width - len(p):] = torch.tensor(p)
                attn[r, width - len(p):] = 1
            kwargs = dict(do_sample=True, temperature=self.cfg.temperature, top_p=self.cfg.top_p) if sample \
                else dict(do_sample=False, temperature=None, top_p=None, top_k=None)
            with torch.inference_mode():
                gen = self.model.generate(input_ids=ids.to(self.device), attention_mask=attn.to(self.device),
                                          max_new_tokens=self.cfg.max_tokens, eos_token_id=sorted(self.eos),
                                          pad_token_id=self.pad, **kwargs)
            for r, i in enumerate(idx):
                new = gen[r, width:].tolist()
                stop = next((n for n, t in enumerate(new) if t in self.eos), None)
                toks = new if stop is None else new[:stop]
                text = self.tokenizer.decode(toks, skip_special_tokens=True)
                if stop is None:
                    # cut at max_tokens inside a multi-byte character: drop the replacement
                    # character(s) of the incomplete bytes, as vLLM's detokenizer does
                    text = text.rstrip("\ufffd")
                out[i] = (text, stop is None)
        return out

    def close(self) -> None:
        del self.model
        if self.device.type == "cuda":
            self.torch.cuda.empty_cache()
