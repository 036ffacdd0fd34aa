"""The OpenAI Responses API: /v1/responses, stored responses and their conversations."""
