"""The ingress's OpenAPI document, as served (behind the API key) at /openapi.json.

The routes read their JSON bodies themselves (`admission.read_json`, so the
size limit and the dialect's error format apply before any parsing), which
hides the bodies from FastAPI's generator. `build_openapi` adds them: each
body route's pydantic request model (`REQUEST_BODIES`), both API-key
schemes, and each dialect's error body on 4XX/5XX responses, so clients,
SDK generators and fuzzers (schemathesis) see what the ingress accepts.
"""

from __future__ import annotations

import importlib
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from kvmesh.ingress.core.errors import Dialect, dialect_of
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

# (method, path) -> "module:Model" of its JSON request body. Modules of parts that are absent are skipped,
# as the app skips their routers.
REQUEST_BODIES = {
    ("post", "/v1/chat/completions"): "kvmesh.ingress.dialects.openai.models:ChatCompletionRequest",
    ("post", "/v1/completions"): "kvmesh.ingress.dialects.openai.models:CompletionRequest",
    ("post", "/v1/responses"): "kvmesh.ingress.dialects.responses.models:ResponsesRequest",
    ("post", "/v1/caches"): "kvmesh.ingress.named_caches.api:CreateCacheRequest",
    ("post", "/v1/messages"): "kvmesh.ingress.dialects.anthropic.models:MessagesRequest",
    ("post", "/v1/messages/count_tokens"): "kvmesh.ingress.dialects.anthropic.models:CountTokensRequest",
}
REF = "#/components/schemas/{model}"
UNAUTHENTICATED = ("/healthz", "/readyz")  # probes answer without a key; every other route wants one

_ERRORS: dict[Dialect, dict[str, Any]] = {
    Dialect.OPENAI: {
        "type": "object", "required": ["error"],
        "properties": {"error": {
            "type": "object", "required": ["message", "type"],
            "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                           "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}},
    Dialect.ANTHROPIC: {
        "type": "object", "required": ["type", "error"],
        "properties": {"type": {"const": "error"}, "error": {
            "type": "object", "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}}},
}
_ERROR_NAMES = {Dialect.OPENAI: "OpenAIError", Dialect.ANTHROPIC: "AnthropicError"}


def _model(spec: str) -> type[BaseModel] | None:
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise
        return None


def build_openapi(app: FastAPI) -> dict[str, Any]:
    """The app's routes as OpenAPI 3.1, with request bodies, security schemes and error bodies filled in."""
    doc = get_openapi(title="kvmesh ingress", version="1",
                      description="OpenAI and Anthropic dialects of one KV-cache-centric LLM server.",
                      routes=app.routes)
    paths: dict[str, dict[str, Any]] = doc.get("paths", {})
    models = {key: m for key, spec in REQUEST_BODIES.items()
              if key[1] in paths and key[0] in paths[key[1]] and (m := _model(spec)) is not None}
    refs, defs = models_json_schema([(m, "validation") for m in models.values()], ref_template=REF)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(defs.get("$defs", {}))
    for unused in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422 bodies, dropped below
        schemas.pop(unused, None)
    for dialect, name in _ERROR_NAMES.items():
        schemas[name] = _ERRORS[dialect]
    for (method, path), model in models.items():
        paths[path][method]["requestBody"] = {
            "required": True, "content": {"application/json": {"schema": refs[(model, "validation")]}}}
    for path, ops in paths.items():
        error = {"$ref": REF.format(model=_ERROR_NAMES[dialect_of(path)])}
        for op in ops.values():
            op.get("responses", {}).pop("422", None)  # FastAPI's own validation shape: this app answers 400
            if path in UNAUTHENTICATED:
                op["security"] = []
            for status, what in (("4XX", "client error, in the route's dialect"), ("5XX", "server error")):
                op.setdefault("responses", {})[status] = {
                    "description": what, "content": {"application/json": {"schema": error}}}
    doc["components"]["securitySchemes"] = {
        "bearer": {"type": "http", "scheme": "bearer", "description": "an API key (OpenAI SDK style)"},
        "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key",
                   "description": "the same API key (Anthropic SDK style)"}}
    doc["security"] = [{"bearer": []}, {"apiKey": []}]
    return doc
