"""Conversations: sources, chat template and loss mask, regeneration, draft vocabulary."""
