"""Ollama's API (/api/*) on Tessera's port, in Ollama's own shapes and error bodies."""
