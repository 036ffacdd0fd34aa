"""What every generation route does before it may publish anything: auth, rate limit, body, model, context.

`admit(request)` authenticates the key, takes a rate-limit token and reads
the JSON body within the size limit; `check_model` and `budget` validate the
rest. Each raises ApiError, so a bad request ends before a job exists.
Dialect modules (OpenAI, Anthropic) call these; the state lives on
`app.state.ingress` (`IngressState`, shared/ingress/core/state.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from kvmesh.ingress.admission.auth import Principal
from kvmesh.ingress.admission.limits import MAX_JSON_DEPTH, check_json_tree
from kvmesh.ingress.core.errors import ApiError, ErrorKind, invalid
from kvmesh.ingress.core.state import IngressState, state_of
from kvmesh.sessions.identity import (
    HDR_SESSION,
    SessionInputError,
    check_id,
    scoped_session_id,
)
from pydantic import BaseModel, ValidationError


@dataclass(slots=True)
class Admitted:
    state: IngressState
    principal: Principal
    body: dict[str, Any]
    request_id: str
    session_id: str | None  # the `x-session-id` header's session, scoped to the tenant (routes without turns)
    headers: Mapping[str, str] = field(default_factory=dict)  # case-insensitive on a real request
    path: str = ""  # the route's path: names the API in the traffic record


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object; 413 past `limit` bytes (declared or streamed), 400 if not a JSON object,
    nested too deep or holding invalid Unicode (limits.check_json_tree)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(ErrorKind.REQUEST_TOO_LARGE, f"request body over {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(ErrorKind.REQUEST_TOO_LARGE, f"request body over {limit} bytes")
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks) or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise invalid(f"malformed JSON body: {exc}") from None
    except RecursionError:  # nesting past the parser's stack: refused like any too-deep body
        raise invalid(f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    check_json_tree(body)
    return body


def authenticated(request: Request) -> tuple[IngressState, Principal]:
    """The process's state and the request's key holder (401 without a valid key)."""
    state = state_of(request)
    return state, state.keyring.authenticate(request)


async def admit(request: Request) -> Admitted:
    state, principal = authenticated(request)
    state.limiter.check(principal.key_id)
    body = await read_json(request, state.settings.max_body_bytes)
    header = request.headers.get(HDR_SESSION)
    try:
        given = check_id(header, HDR_SESSION) if header and header.strip() else None
        session_id = scoped_session_id(principal.tenant, given) if given else None
    except SessionInputError as exc:
        raise invalid(exc.message, param=exc.param) from None
    return Admitted(state, principal, body, request.state.request_id, session_id, request.headers,
                    request.url.path)


M = TypeVar("M", bound=BaseModel)


def parse(model: type[M], body: dict[str, Any]) -> M:
    """Validate a body; the first problem becomes a 400 naming the field."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise invalid(f"{where}: {first['msg']}" if where else first["msg"], param=where or None) from None


async def admit_as(request: Request, model: type[M]) -> tuple[Admitted, M]:
    """`admit`, then the body validated as `model`, naming the model this server serves."""
    adm = await admit(request)
    body = parse(model, adm.body)
    check_model(adm.state, body.model)  # type: ignore[attr-defined]
    return adm, body


def check_model(state: IngressState, model: str) -> None:
    if model != state.model_id:
        raise ApiError(ErrorKind.NOT_FOUND, f"the model '{model}' does not exist (this server serves "
                                            f"'{state.model_id}')", param="model")


def budget(state: IngressState, prompt_tokens: int, max_tokens: int | None) -> int:
    """max_tokens to use: the asked one if prompt + it fits the context, else 400; default: the rest."""
    room = state.context_len - prompt_tokens
    if prompt_tokens == 0:
        raise invalid("the prompt is empty")
    if max_tokens is None:
        if room < 1:
            raise invalid(f"the prompt ({prompt_tokens} tokens) fills the model's context of "
                          f"{state.context_len} tokens", param="messages")
        return room
    if max_tokens > room:
        raise invalid(f"this model's maximum context length is {state.context_len} tokens; the request asks "
                      f"{prompt_tokens} prompt + {max_tokens} completion tokens", param="max_tokens")
    return max_tokens
