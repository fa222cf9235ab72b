"""Conversations: sources, chat template and loss mask, regeneration, draft vocabulary; build.py
is the prepare stage's work in order (with stats.json derived from its facts)."""
