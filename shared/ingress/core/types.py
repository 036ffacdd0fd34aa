"""The request and result types every part of the ingress passes along.

A dialect builds a `GenerationRequest` (shared/ingress/dialects/common.py), the gateway runs it and fills
its `Usage` as events arrive, and a failure that supervision cannot repair is a `GatewayError`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvmesh.ingress.core.errors import ErrorKind
from kvmesh.protocol.serving import CachePin, SamplingSpec, TokenEvent


@dataclass(slots=True)
class GenerationRequest:
    """What a dialect hands the gateway after auth and validation; nothing here comes unchecked from a client."""

    request_id: str  # a subject token: letters, digits, '-', '_'
    tenant: str
    tenant_salt: str  # hex, from auth.KeyRing
    prompt_ids: list[int]
    sampling: SamplingSpec
    session_id: str | None = None
    affinity_key: str | None = None  # prompt_cache_key, else the session group root's id: routes to the same workers
    pins: list[CachePin] = field(default_factory=list)
    prefill_only: bool = False  # named-cache creation: store the prompt's blocks, generate nothing
    block_hashes: list[bytes] | None = None  # the prompt's full blocks as the workers hash them, if known
    # Called once the first PrefillJob is on the bus: what the request's own path need not wait for
    # (the session's turn-started event) goes out then, instead of competing with the job for the cores.
    on_dispatched: Callable[[], None] | None = None


@dataclass(slots=True)
class Usage:
    """Usage as the first event of a request reports it (prefill knows the prompt and its cache hit),
    and where the request ran (filled by the supervisor: the last workers and the attempts it took)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    cache_created_tokens: int = 0
    prefill_worker: str = ""
    decode_worker: str = ""
    attempts: int = 1
    first_token_at: float = 0.0  # time.monotonic() when the first token arrived
    finished_by: str = ""  # the worker that sent the final event: its L1 holds the turn's chain
    tier_tokens: dict[str, int] | None = None  # where cached_tokens came from, if the prefill worker said
    pins: list[CachePin] = field(default_factory=list)  # what the request asked to keep (writes by TTL)

    def take(self, event: TokenEvent) -> None:
        if not self.first_token_at:
            self.first_token_at = time.monotonic()
        if event.finished:
            self.finished_by = event.worker_id
        if event.prompt_tokens and not self.prompt_tokens:
            self.prompt_tokens = event.prompt_tokens
            self.cached_tokens = event.cached_tokens
            self.tier_tokens = event.tier_tokens
        self.cache_created_tokens = max(self.cache_created_tokens, event.cache_created_tokens)


def route_header(usage: Usage) -> dict[str, str]:
    """`kvmesh-route: prefill=<id>;decode=<id>;attempts=<n>`: where a request ran, for operators and tests."""
    return {"kvmesh-route": f"prefill={usage.prefill_worker};decode={usage.decode_worker};attempts={usage.attempts}"}


@dataclass(slots=True)
class Completion:
    """A whole response (non-streaming): the concatenated stream and its usage."""

    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    cache_created_tokens: int
    usage: Usage


class GatewayError(Exception):
    """The request cannot finish; `kind` picks the dialect's status, `retriable` tells the client to retry."""

    def __init__(self, kind: ErrorKind, message: str, retriable: bool = True) -> None:
        super().__init__(message)
        self.kind, self.message, self.retriable = kind, message, retriable
