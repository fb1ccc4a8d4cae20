"""Anthropic's Messages API (what Claude Code speaks), translated onto the chat conversion core."""
