"""The API dialects (OpenAI Chat and Completions, Anthropic Messages, OpenAI Responses) over one common
request path (common.py)."""
