"""OpenAI's API: chat completions, completions and embeddings. Its ChatCompletionRequest
(protocol.py) is also the conversion core the Responses, Messages and Ollama chat APIs
translate into."""
