"""Named caches: POST/GET/DELETE /v1/caches, and `cache_id` on requests of both dialects.

`POST /v1/caches {model, system?, tools?, messages?, ttl | ttl_seconds}`
renders the prefix (chat template, no generation prompt, piecewise ids as
every request), pins it whole in the eviction service for the tenant (a 429
when that passes the tenant's pin cap, which is its L3 quota, or the
deployment's: admission/pins.py), runs a `prefill_only` job pinned for the
TTL (the prefill worker computes it, pins it and writes it to L3 with the
cache's TTL, which wins over the upload's), then stores the
metadata (store.py) and returns `{id: "cache_...", ...}`.
DELETE releases the pins. TTL:
60 s to 30 days (`ttl` as "90s", "5m", "1h", "7d"). Every route is
tenant-scoped: another tenant's cache is a 404, as is an expired one.
A request with `cache_id` gets the cache's messages and tools put first
(`install` sets `IngressState.cache_lookup`), so its prompt starts with the
cached blocks: L1/L2 while warm, L3 after a restart.
"""

from __future__ import annotations

import hashlib
import re
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from kvmesh.engine.chat_template import ChatTemplateError
from kvmesh.ingress.admission.admit import (
    admit_as,
    authenticated,
    budget,
)
from kvmesh.ingress.admission.auth import Principal
from kvmesh.ingress.admission.pins import admit_pins, prompt_hashes, release_pins
from kvmesh.ingress.core.errors import ApiError, ErrorKind, invalid
from kvmesh.ingress.core.state import CachedContext, IngressState
from kvmesh.ingress.dialects.anthropic.models import (
    InputMessage,
    TextBlock,
    Tool,
    conversation,
    function_tool,
    system_blocks,
)
from kvmesh.ingress.dialects.common import generation_request
from kvmesh.ingress.named_caches.store import NamedCache, NamedCacheStore
from kvmesh.protocol.serving import CachePin, SamplingSpec
from pydantic import BaseModel, ConfigDict, Field, model_validator

router = APIRouter()

MIN_TTL_S = 60
MAX_TTL_S = 30 * 24 * 3600
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_STORE = "named_caches"


def parse_ttl(text: str) -> int:
    """'90s' / '5m' / '1h' / '7d' -> seconds; ValueError otherwise."""
    m = re.fullmatch(r"\s*(\d+)\s*([smhd])\s*", text)
    if not m:
        raise ValueError(f"ttl {text!r}: want a number and a unit s/m/h/d, e.g. '5m' or '7d'")
    return int(m.group(1)) * _UNITS[m.group(2)]


def _tool(raw: dict[str, Any]) -> dict[str, Any]:
    """An Anthropic tool ({name, input_schema}) or an OpenAI one ({type: function, function}) in template shape."""
    if raw.get("type") == "function" and isinstance(raw.get("function"), dict):
        fn = raw["function"]
        return function_tool(str(fn.get("name", "")), fn.get("description"), fn.get("parameters") or {})
    return Tool.model_validate(raw).flat()


class CreateCacheRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    system: str | list[TextBlock] | None = None
    tools: list[dict[str, Any]] | None = None
    messages: list[InputMessage] = Field(default_factory=list)
    ttl: str | None = None
    ttl_seconds: int | None = None
    display_name: str | None = Field(default=None, max_length=256)

    @model_validator(mode="after")
    def _something(self) -> CreateCacheRequest:
        if not self.messages and not system_blocks(self.system):
            raise ValueError("a cache needs a system prompt or messages")
        return self

    def ttl_s(self) -> int:
        try:
            ttl = self.ttl_seconds if self.ttl_seconds is not None else parse_ttl(self.ttl or "5m")
        except ValueError as exc:
            raise invalid(str(exc), param="ttl") from None
        if not MIN_TTL_S <= ttl <= MAX_TTL_S:
            raise invalid(f"ttl must be between {MIN_TTL_S} s and 30 days, got {ttl} s", param="ttl")
        return ttl


def store_of(state: IngressState) -> NamedCacheStore:
    store = state.extra.get(_STORE)
    if store is None:
        store = state.extra[_STORE] = NamedCacheStore(state.gateway.nc.jetstream())
    return store


def install(state: IngressState) -> None:
    """Let requests of every dialect name a cache (`cache_id`)."""

    async def lookup(principal: Principal, cache_id: str) -> CachedContext:
        cache = await store_of(state).get(principal.tenant, cache_id)
        if cache is None:
            raise ApiError(ErrorKind.NOT_FOUND, f"cache '{cache_id}' not found (or expired)", param="cache_id")
        return CachedContext(list(cache.messages), list(cache.tools) if cache.tools else None)

    state.cache_lookup = lookup


def _not_found(cache_id: str) -> ApiError:
    return ApiError(ErrorKind.NOT_FOUND, f"cache '{cache_id}' not found (or expired)")


@router.post("/v1/caches")
async def create_cache(request: Request) -> Any:
    adm, body = await admit_as(request, CreateCacheRequest)
    ttl = body.ttl_s()
    try:
        tools = [_tool(t) for t in body.tools or []]
    except (ValueError, TypeError) as exc:
        raise invalid(f"tools: {exc}", param="tools") from None
    conv, _ = conversation([], system_blocks(body.system), body.messages)
    conv.tools = tools or None
    tenant = adm.principal.tenant
    ids = _prefix_ids(adm.state, tenant, conv.messages, conv.tools)
    budget(adm.state, len(ids), 1)
    pins = [CachePin(num_tokens=len(ids), ttl_s=float(ttl))]
    hashes = prompt_hashes(adm.state, ids, adm.principal.salt)
    await admit_pins(adm, pins, hashes, whole=True)
    req = generation_request(adm, ids, SamplingSpec(max_tokens=1), pins=pins, prefill_only=True)
    try:
        done = await adm.state.gateway.complete(req)
    except BaseException:
        await release_pins(adm.state, adm.principal.salt, hashes)  # no cache: its budget is free again
        raise
    now = time.time()
    cache = NamedCache(id="cache_" + uuid.uuid4().hex, tenant=tenant, model=body.model,
                       display_name=body.display_name, messages=conv.messages, tools=conv.tools,
                       prompt_tokens=len(ids), prefix_sha256=hashlib.sha256(str(ids).encode()).hexdigest(),
                       created_at=now, expires_at=now + ttl, cached_tokens=done.cached_tokens,
                       cache_created_tokens=done.cache_created_tokens)
    await store_of(adm.state).put(cache)
    return JSONResponse(cache.public())


def _prefix_ids(state: IngressState, tenant: str, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None) -> list[int]:
    """The cache's prompt ids: its conversation rendered without a generation prompt; 400 if it cannot be."""
    prompts = state.prompts
    try:
        return prompts.tokenize(tenant, prompts.render(messages, tools, generation_prompt=False), messages)
    except ChatTemplateError as exc:
        raise invalid(f"messages: {exc}", param="messages") from None


@router.get("/v1/caches")
async def list_caches(request: Request) -> Any:
    state, principal = authenticated(request)
    caches = await store_of(state).list(principal.tenant)
    return {"object": "list", "data": [c.public() for c in caches]}


@router.get("/v1/caches/{cache_id}")
async def get_cache(request: Request, cache_id: str) -> Any:
    state, principal = authenticated(request)
    cache = await store_of(state).get(principal.tenant, cache_id)
    if cache is None:
        raise _not_found(cache_id)
    return cache.public()


@router.delete("/v1/caches/{cache_id}")
async def delete_cache(request: Request, cache_id: str) -> Any:
    state, principal = authenticated(request)
    store = store_of(state)
    cache = await store.get(principal.tenant, cache_id)
    if cache is None or not await store.delete(principal.tenant, cache_id):
        raise _not_found(cache_id)
    try:
        ids = _prefix_ids(state, principal.tenant, list(cache.messages), list(cache.tools) if cache.tools else None)
    except ApiError:  # the template changed since: its pins go when they expire
        return {"id": cache_id, "object": "cache.deleted", "deleted": True}
    await release_pins(state, principal.salt, prompt_hashes(state, ids, principal.salt))
    return {"id": cache_id, "object": "cache.deleted", "deleted": True}
