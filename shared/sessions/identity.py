"""Session identity: which of a tenant's sessions a request belongs to, and the client's hints about it.

A session is named by the client (explicit) or inferred by the ingress from
the request's block chain (shared/ingress/sessions/table.py). Explicit
sources, first present wins:

1. the `x-session-id` header (both dialects);
2. NVIDIA Dynamo's `x-dynamo-session-id` header (both dialects);
3. OpenAI `metadata.session_id`;
4. OpenAI `prompt_cache_key`;
5. OpenAI `safety_identifier`, then `user` (an end user: coarser than a conversation);
6. Anthropic `metadata.user_id`.

Only the chosen value is validated (1-256 printable characters; an empty
string counts as absent): a bad one is a `SessionInputError`, which the
ingress turns into a 400 in the request's dialect before anything is
published. A session id is scoped to its tenant: `scoped_session_id(tenant,
client_id)` is what jobs, KV events and session events carry, so two tenants
using the same id are two sessions; the client's own id stays in the logs.

Hints (both optional; a header wins over the body extension, which wins
over the same hint in another system's format, shared/sessions/foreign_hints.py):
`x-kvmesh-expected-return-ms` / `"kvmesh": {"expected_return_ms": N}` (when
the client expects to send the next turn) and `x-kvmesh-session-end: true` /
`"kvmesh": {"session_end": true}` (this is the session's last turn). The
extension's third field, `parent_session_id`, names the session a sub-agent
was forked from (shared/sessions/lineage.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

MAX_ID_CHARS = 256
MAX_RETURN_MS = 7 * 24 * 3600 * 1000  # a week: beyond that a hint says nothing a cache can use

HDR_SESSION = "x-session-id"
HDR_DYNAMO_SESSION = "x-dynamo-session-id"  # NVIDIA Dynamo's name for the same thing
HDR_EXPECTED_RETURN = "x-kvmesh-expected-return-ms"
HDR_SESSION_END = "x-kvmesh-session-end"
BODY_EXTENSION = "kvmesh"

_EXTENSION_KEYS = frozenset({"expected_return_ms", "session_end", "parent_session_id"})  # the last: lineage.py
_TRUE, _FALSE = frozenset({"true", "1", "yes"}), frozenset({"false", "0", "no"})


class SessionInputError(ValueError):
    """A session id or hint the client sent is malformed; `param` names where it came from."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message, self.param = message, param


class Source(StrEnum):
    """Where a request's session came from (a metric label: a bounded set)."""

    HEADER = "header"
    DYNAMO_HEADER = "x-dynamo-session-id"
    METADATA = "metadata.session_id"
    PROMPT_CACHE_KEY = "prompt_cache_key"
    SAFETY_IDENTIFIER = "safety_identifier"
    USER = "user"
    ANTHROPIC_USER = "metadata.user_id"
    PREVIOUS_RESPONSE = "previous_response_id"  # /v1/responses: the stored response's session continues
    INFERRED = "inferred"  # continues the session whose last turn this request extends
    NEW = "new"  # nothing named or matched it: a fresh, generated session


@dataclass(frozen=True, slots=True)
class SessionRef:
    """A request's session: `client_id` as the client knows it (or generated), scoped to `tenant`."""

    tenant: str
    client_id: str
    source: Source

    @property
    def named(self) -> bool:
        """The client named the session (any source but inference and a fresh one)."""
        return self.source not in (Source.INFERRED, Source.NEW)

    @property
    def session_id(self) -> str:
        return scoped_session_id(self.tenant, self.client_id)

    @property
    def explicit(self) -> bool:
        return self.source not in (Source.INFERRED, Source.NEW)


@dataclass(frozen=True, slots=True)
class SessionHints:
    expected_return_ms: int | None = None
    session_end: bool = False


def scoped_session_id(tenant: str, client_id: str) -> str:
    """The fleet-wide id of `client_id` within `tenant`: deterministic (every ingress replica agrees), a
    subject-safe token of fixed length, and different for two tenants with the same client id."""
    h = hashlib.sha256(b"kvmesh.session.v1")
    for part in (tenant, client_id):
        raw = part.encode()
        h.update(len(raw).to_bytes(4, "little") + raw)
    return "s-" + h.hexdigest()[:32]


def check_id(value: str, param: str) -> str:
    """`value` stripped if it is a usable id (1-256 printable characters), else SessionInputError."""
    stripped = value.strip()
    if not stripped:
        raise SessionInputError(f"{param}: the session id is empty", param)
    if len(stripped) > MAX_ID_CHARS:
        raise SessionInputError(f"{param}: a session id has at most {MAX_ID_CHARS} characters "
                                f"(got {len(stripped)})", param)
    if not stripped.isprintable():
        raise SessionInputError(f"{param}: a session id must be printable text", param)
    return stripped


def _present(value: Any) -> bool:
    return value is not None and not (isinstance(value, str) and not value.strip())


def _first(candidates: list[tuple[Source, str, Any]]) -> tuple[Source, str] | None:
    """The first present candidate, validated: (source, id)."""
    for source, param, value in candidates:
        if not _present(value):
            continue
        if not isinstance(value, str):
            raise SessionInputError(f"{param}: a session id must be a string", param)
        return source, check_id(value, param)
    return None


def explicit_openai(headers: Mapping[str, str], body: Mapping[str, Any]) -> tuple[Source, str] | None:
    """The session an OpenAI request names, by the precedence in the module docstring; None: none named."""
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, Mapping):
        raise SessionInputError("metadata: must be an object of strings", "metadata")
    return _first([
        (Source.HEADER, HDR_SESSION, headers.get(HDR_SESSION)),
        (Source.DYNAMO_HEADER, HDR_DYNAMO_SESSION, headers.get(HDR_DYNAMO_SESSION)),
        (Source.METADATA, "metadata.session_id", (metadata or {}).get("session_id")),
        (Source.PROMPT_CACHE_KEY, "prompt_cache_key", body.get("prompt_cache_key")),
        (Source.SAFETY_IDENTIFIER, "safety_identifier", body.get("safety_identifier")),
        (Source.USER, "user", body.get("user")),
    ])


def explicit_anthropic(headers: Mapping[str, str], body: Mapping[str, Any]) -> tuple[Source, str] | None:
    """The session an Anthropic request names: a header, else `metadata.user_id`; None: none named."""
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, Mapping):
        raise SessionInputError("metadata: must be an object", "metadata")
    return _first([
        (Source.HEADER, HDR_SESSION, headers.get(HDR_SESSION)),
        (Source.DYNAMO_HEADER, HDR_DYNAMO_SESSION, headers.get(HDR_DYNAMO_SESSION)),
        (Source.ANTHROPIC_USER, "metadata.user_id", (metadata or {}).get("user_id")),
    ])


def _return_ms(value: Any, param: str) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_RETURN_MS:
        raise SessionInputError(f"{param}: expected return time must be a whole number of milliseconds "
                                f"from 0 to {MAX_RETURN_MS}", param)
    return value


def _flag(value: Any, param: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise SessionInputError(f"{param}: must be true or false", param)


def hints(headers: Mapping[str, str], body: Mapping[str, Any], fallback: SessionHints = SessionHints()
          ) -> SessionHints:
    """The client's hints from the headers and the `kvmesh` body extension, each one falling back to
    `fallback` (the foreign formats' hints) where kvmesh's own say nothing; SessionInputError if malformed."""
    ext = body.get(BODY_EXTENSION)
    if ext is None:
        ext = {}
    if not isinstance(ext, Mapping):
        raise SessionInputError(f"{BODY_EXTENSION}: must be an object", BODY_EXTENSION)
    unknown = sorted(set(ext) - _EXTENSION_KEYS)
    if unknown:
        raise SessionInputError(f"{BODY_EXTENSION}: unknown field {unknown[0]!r} (known: "
                                f"{', '.join(sorted(_EXTENSION_KEYS))})", f"{BODY_EXTENSION}.{unknown[0]}")
    ret = fallback.expected_return_ms
    if headers.get(HDR_EXPECTED_RETURN) is not None:
        ret = _return_ms(headers[HDR_EXPECTED_RETURN], HDR_EXPECTED_RETURN)
    elif ext.get("expected_return_ms") is not None:
        ret = _return_ms(ext["expected_return_ms"], f"{BODY_EXTENSION}.expected_return_ms")
    end = fallback.session_end
    if headers.get(HDR_SESSION_END) is not None:
        end = _flag(headers[HDR_SESSION_END], HDR_SESSION_END)
    elif ext.get("session_end") is not None:
        end = _flag(ext["session_end"], f"{BODY_EXTENSION}.session_end")
    return SessionHints(ret, end)
