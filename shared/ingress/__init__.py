"""The HTTP ingress: dialects (OpenAI, Anthropic), auth, limits, prompts, routing and request supervision."""
