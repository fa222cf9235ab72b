"""The built-in prompt sets (prompts.jsonl; make_prompts.py generates it and the large set)."""
