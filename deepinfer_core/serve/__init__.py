"""The HTTP server: OpenAI Chat Completions, Completions, Responses and Anthropic Messages."""
