"""The ingress's per-process state, shared by every route (on `app.state.ingress`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from kvmesh.config import IngressSettings
from kvmesh.ingress.admission.auth import KeyRing, Principal
from kvmesh.ingress.admission.limits import RateLimiter
from kvmesh.ingress.core.metrics import IngressMetrics
from kvmesh.ingress.core.prompt import PromptBuilder
from kvmesh.ingress.sessions.tracker import SessionTracker
from kvmesh.ingress.supervision.gateway import Gateway
from kvmesh.toolcalls.formats import HERMES, ToolFormat

# Named caches (third part) plug in here: (principal, cache_id) -> the cached context to prepend.
CacheLookup = Callable[[Principal, str], Awaitable["CachedContext"]]


@dataclass(slots=True)
class CachedContext:
    """A named cache's content, prepended to a request that names it (`cache_id`)."""

    messages: list[dict]  # role/content dicts, system first if any
    tools: list[dict] | None = None


@dataclass(slots=True)
class IngressState:
    """Everything the routes share; one per process, on `app.state.ingress`."""

    settings: IngressSettings
    keyring: KeyRing
    limiter: RateLimiter
    prompts: PromptBuilder
    gateway: Gateway
    metrics: IngressMetrics
    model_id: str
    context_len: int
    sessions: SessionTracker  # session identity, inference and turn events (shared/ingress/sessions/tracker.py)
    cache_lookup: CacheLookup | None = None
    tool_format: ToolFormat = HERMES  # how this model writes tool calls (from its chat template; settings override)
    extra: dict[str, Any] = field(default_factory=dict)  # other parts' per-process objects, by name


def state_of(request: Request) -> IngressState:
    return request.app.state.ingress
