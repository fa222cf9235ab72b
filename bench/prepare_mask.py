"""Throughput of assistant-mask tokenization (eagle3.data.chat_template) on single-turn chat data.

Renders, tokenizes and masks ~2000 synthetic single-turn conversations with the real SmolLM2
tokenizer and chat template (from the packaged GGUF), batched as the prepare stage calls it and one
conversation at a time. Prints a table; writes raw numbers to $OUT/prepare_mask.json if $OUT is set.

    python bench/prepare_mask.py [--n 2000] [--batch 256]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

WORDS = ("the a model token python function returns list value error file data train step loss "
         "because when which explain write simple example number sum average string loop class "
         "method result input output first second then finally note that this is how it works").split()


def synthetic_records(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)

    def sentence(k: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + "."

    records = []
    for i in range(n):
        question = " ".join(sentence(rng.randint(6, 14)) for _ in range(rng.randint(1, 3)))
        answer = " ".join(sentence(rng.randint(6, 18)) for _ in range(rng.randint(4, 16)))
        if i % 3 == 0:  # some code, whose indentation tokenizes differently
            answer += "\n\n```python\ndef f(x):\n    return [v * 2 for v in x]\n```\n"
        records.append({"messages": [{"role": "user", "content": question},
                                     {"role": "assistant", "content": answer}]})
    return records


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=256)
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from eagle3.data.chat_template import normalize_messages, tokenize_conversation, tokenize_conversations
    from eagle3.gguf_convert import default_gguf

    gguf = default_gguf()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    records = synthetic_records(args.n)
    tokenize_conversation(tok, normalize_messages(records[0]))  # learns the template once

    rows = []
    t0 = time.perf_counter()
    n_tok = n_masked = 0
    for b in range(0, len(records), args.batch):
        convs = [normalize_messages(r) for r in records[b:b + args.batch]]
        for ids, mask in tokenize_conversations(tok, convs):
            n_tok += len(ids)
            n_masked += sum(mask)
    dt = time.perf_counter() - t0
    rows.append({"mode": f"batched ({args.batch})", "conversations": len(records), "tokens": n_tok,
                 "masked": n_masked, "seconds": dt, "tokens_per_s": n_tok / dt})

    t0 = time.perf_counter()
    n_tok = n_masked = 0
    for r in records:
        ids, mask = tokenize_conversation(tok, normalize_messages(r))
        n_tok += len(ids)
        n_masked += sum(mask)
    dt = time.perf_counter() - t0
    rows.append({"mode": "one at a time", "conversations": len(records), "tokens": n_tok,
                 "masked": n_masked, "seconds": dt, "tokens_per_s": n_tok / dt})

    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        Path(os.environ["OUT"], "prepare_mask.json").write_text(json.dumps(rows, indent=2))
    print(f"\nassistant-mask tokenization, SmolLM2 tokenizer, {os.cpu_count()} CPUs")
    print(f"{'mode':<16} {'convs':>6} {'tokens':>9} {'masked':>9} {'seconds':>8} {'tokens/s':>10}")
    for r in rows:
        print(f"{r['mode']:<16} {r['conversations']:>6} {r['tokens']:>9} {r['masked']:>9} "
              f"{r['seconds']:>8.2f} {r['tokens_per_s']:>10,.0f}")


if __name__ == "__main__":
    main()
