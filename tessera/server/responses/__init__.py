"""OpenAI's Responses API (what Codex CLI speaks), translated onto the chat conversion core."""
