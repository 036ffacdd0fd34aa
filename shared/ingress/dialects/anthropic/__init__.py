"""The Anthropic dialect: /v1/messages and its prompt-caching surface (cache_control)."""
