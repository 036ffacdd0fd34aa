"""The OpenAI dialect: /v1/chat/completions, /v1/completions, /v1/models.

Bodies, usage (`prompt_tokens_details.cached_tokens`), streaming chunks
(`stream_options.include_usage` adds the final usage chunk) and error
objects follow the OpenAI API, so the official SDK works unchanged. A
stream waits for its first token before answering 200: anything that fails
earlier (no worker, retries spent) is a proper error status; a failure after
that ends the stream with an `{"error": ...}` event and no `[DONE]`, which
the SDK raises on.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from kvmesh.engine.chat_template import ChatTemplateError
from kvmesh.ingress.admission import (
    Admitted,
    admit,
    budget,
    check_model,
    parse,
    state_of,
)
from kvmesh.ingress.errors import ApiError, Dialect, ErrorKind, invalid
from kvmesh.ingress.gateway import GatewayError, GenerationRequest, Usage, route_header
from kvmesh.ingress.openai_chat_output import (
    FINISH,
    ChatDeltas,
    chat_message,
    finish_reason,
)
from kvmesh.ingress.openai_models import (
    ChatCompletionRequest,
    CompletionRequest,
    JsonObjectFormat,
    JsonSchemaResponseFormat,
    _Common,
)
from kvmesh.ingress.sessions import Turn, inputs
from kvmesh.ingress.sse import SSE_HEADERS, sse
from kvmesh.ingress.tool_choice import (
    ToolParsing,
    json_constraint,
    request_constraint,
    tool_parsing,
    tool_schemas,
)
from kvmesh.log import get_logger
from kvmesh.protocol.serving import Constraint, SamplingSpec, TokenEvent
from kvmesh.sessions.outcome import ToolEvidence, tool_evidence

log = get_logger(__name__)
router = APIRouter()


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    state = state_of(request)
    state.keyring.authenticate(request)
    return {"object": "list", "data": [{"id": state.model_id, "object": "model", "created": 0, "owned_by": "kvmesh"}]}


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Any:
    adm = await admit(request)
    body = parse(ChatCompletionRequest, adm.body)
    check_model(adm.state, body.model)
    given = inputs(adm, Dialect.OPENAI)
    messages = [m.flat() for m in body.messages]
    tools = body.tools
    if body.cache_id is not None:
        if adm.state.cache_lookup is None:
            raise ApiError(ErrorKind.NOT_FOUND, "named caches are not enabled", param="cache_id")
        cached = await adm.state.cache_lookup(adm.principal, body.cache_id)
        messages = cached.messages + messages
        tools = (cached.tools or []) + (tools or []) or None
    constraint, parsing = _tools(adm, body, tools)
    try:
        prompt_ids = adm.state.prompts.chat(adm.principal.tenant, messages, tools)
    except ChatTemplateError as exc:
        raise invalid(f"messages: {exc}", param="messages") from None
    turn = adm.state.sessions.begin(adm, given, prompt_ids, tool_evidence(messages, tools))
    req = _generation(adm, body, turn, body.token_limit(), constraint)
    return await _respond(adm, req, body, turn, chat=True, parsing=parsing)


def _tools(adm: Admitted, body: ChatCompletionRequest, tools: list[dict[str, Any]] | None
           ) -> tuple[Constraint | None, ToolParsing | None]:
    """What to force (tool_choice required/named, else response_format) and whether to parse calls out of
    the output (tools offered, tool_choice not "none"); a 400 before anything is queued."""
    schemas = tool_schemas(tools)
    choice = body.choice()
    fmt = adm.state.tool_format
    answer = None
    if isinstance(body.response_format, JsonObjectFormat):
        answer = json_constraint(None)
    elif isinstance(body.response_format, JsonSchemaResponseFormat):
        answer = json_constraint(body.response_format.json_schema.schema_)
    constraint = request_constraint(schemas, choice, fmt, body.parallel_tool_calls, answer, "response_format")
    return constraint, tool_parsing(schemas, choice, fmt)


@router.post("/v1/completions")
async def completions(request: Request) -> Any:
    adm = await admit(request)
    body = parse(CompletionRequest, adm.body)
    check_model(adm.state, body.model)
    given = inputs(adm, Dialect.OPENAI)
    prompt_ids = adm.state.prompts.encode(body.text())
    turn = adm.state.sessions.begin(adm, given, prompt_ids, ToolEvidence())
    req = _generation(adm, body, turn, body.max_tokens)
    return await _respond(adm, req, body, turn, chat=False)


def _generation(adm: Admitted, body: _Common, turn: Turn, max_tokens: int | None,
                constraint: Constraint | None = None) -> GenerationRequest:
    prompt_ids = turn.prompt_ids
    limit = budget(adm.state, len(prompt_ids), max_tokens)
    sampling = SamplingSpec(max_tokens=limit, temperature=float(body.temperature), top_p=float(body.top_p),
                            seed=body.seed, stop=body.stop_list(), constraint=constraint)
    if body.user or body.safety_identifier:
        log.info("request identity", user=body.user, safety_identifier=body.safety_identifier)
    return GenerationRequest(
        request_id=adm.request_id, tenant=adm.principal.tenant, tenant_salt=adm.principal.salt,
        prompt_ids=prompt_ids, sampling=sampling, session_id=turn.session_id,
        affinity_key=body.prompt_cache_key or turn.session_id,
        block_hashes=turn.prompt_hashes if adm.state.sessions.hasher.named else None,
    )


def _usage(usage: Usage, completion_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": usage.prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def _choice(chat: bool, text: str | None, finish: str | None, first: bool = False) -> dict[str, Any]:
    reason = None if finish is None else FINISH.get(finish, finish)
    if not chat:
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
    delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
    if text:
        delta["content"] = text
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}


def _delta(delta: dict[str, Any], reason: str | None = None) -> dict[str, Any]:
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}


def _envelope(req: GenerationRequest, model: str, chat: bool, stream: bool) -> dict[str, Any]:
    obj = ("chat.completion.chunk" if stream else "chat.completion") if chat else "text_completion"
    prefix = "chatcmpl-" if chat else "cmpl-"
    return {"id": prefix + req.request_id.removeprefix("req_"), "object": obj, "created": int(time.time()),
            "model": model, "system_fingerprint": None}


def _account(adm: Admitted, usage: Usage, completion_tokens: int) -> None:
    log.info("request finished", tenant=adm.principal.tenant, prompt_tokens=usage.prompt_tokens,
             cached_tokens=usage.cached_tokens, completion_tokens=completion_tokens, attempts=usage.attempts,
             prefill_worker=usage.prefill_worker, decode_worker=usage.decode_worker)
    m = adm.state.metrics
    m.prompt_tokens.inc(usage.prompt_tokens)
    m.cached_tokens.inc(usage.cached_tokens)
    m.completion_tokens.inc(completion_tokens)


async def _respond(adm: Admitted, req: GenerationRequest, body: _Common, turn: Turn, chat: bool,
                   parsing: ToolParsing | None = None) -> Any:
    route = "chat" if chat else "completions"
    started = time.monotonic()
    if not body.stream:
        done = await adm.state.gateway.complete(req)
        usage = done.usage
        adm.state.metrics.ttft_seconds.labels(route).observe(usage.first_token_at - started)
        _account(adm, usage, len(done.token_ids))
        answer = adm.state.prompts.remember_answer(req.tenant, done.text, done.token_ids) if chat else None
        called: list[str] = []
        if chat:
            message, called = chat_message(done.text, parsing)
            choice = {"index": 0, "message": message, "logprobs": None,
                      "finish_reason": finish_reason(done.finish_reason, bool(called))}
        else:
            choice = _choice(False, done.text, done.finish_reason)
        adm.state.sessions.finish(turn, done.token_ids, answer, "tool_calls" if called else done.finish_reason,
                                  usage.prefill_worker or usage.finished_by, called, usage=usage)
        return JSONResponse({**_envelope(req, body.model, chat, False), "choices": [choice],
                             "usage": _usage(usage, len(done.token_ids))},
                            headers={**route_header(done.usage), **turn.header()})

    usage = Usage()
    events = adm.state.gateway.stream(req, usage).__aiter__()
    first = await events.__anext__()  # GatewayError here is still an HTTP error status
    adm.state.metrics.ttft_seconds.labels(route).observe(usage.first_token_at - started)
    return StreamingResponse(_chunks(adm, req, body, turn, chat, usage, first, events, ChatDeltas(parsing)),
                             media_type="text/event-stream",
                             headers={**SSE_HEADERS, **route_header(usage), **turn.header()})


async def _chunks(adm: Admitted, req: GenerationRequest, body: _Common, turn: Turn, chat: bool, usage: Usage,
                  first: TokenEvent, events: AsyncIterator[TokenEvent], deltas: ChatDeltas) -> AsyncIterator[bytes]:
    env = _envelope(req, body.model, chat, True)
    tail = {"usage": None} if body.include_usage else {}
    ids: list[int] = []
    text: list[str] = []
    finish: str | None = None
    try:
        if chat:
            yield sse({**env, "choices": [_choice(True, None, None, first=True)], **tail})
        event = first
        while True:
            ids += event.token_ids
            text.append(event.text)
            pieces = deltas.feed(event.text) if chat else [{"content": event.text}] if event.text else []
            if event.finished and chat:
                pieces += deltas.finish()
            for piece in pieces:
                choice = _delta(piece) if chat else _choice(False, piece["content"], None)
                yield sse({**env, "choices": [choice], **tail})
            if event.finished:
                finish = "tool_calls" if deltas.called else event.finish_reason or "stop"
                reason = finish_reason(event.finish_reason or "stop", bool(deltas.called))
                yield sse({**env, "choices": [_choice(chat, None, reason)], **tail})
                break
            event = await events.__anext__()
        if body.include_usage:
            yield sse({**env, "choices": [], "usage": _usage(usage, len(ids))})
        yield sse("[DONE]")
        _account(adm, usage, len(ids))
        answer = adm.state.prompts.remember_answer(req.tenant, "".join(text), ids) if chat else None
        adm.state.sessions.finish(turn, ids, answer, finish, usage.prefill_worker or usage.finished_by, deltas.called,
                                  usage=usage)
    except GatewayError as exc:
        log.warning("stream ended with an error", error=exc.message)
        yield sse(ApiError(exc.kind, exc.message).body(Dialect.OPENAI))
    finally:
        await events.aclose()  # type: ignore[attr-defined]
