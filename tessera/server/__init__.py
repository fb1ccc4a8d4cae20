"""The OpenAI-compatible HTTP server (`tessera serve`); see app.py."""
