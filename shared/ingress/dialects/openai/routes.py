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
from kvmesh.engine.chat_template import ChatTemplateError
from kvmesh.ingress.admission.admit import (
    Admitted,
    admit_as,
    authenticated,
    budget,
)
from kvmesh.ingress.core.errors import ApiError, Dialect, ErrorKind, invalid
from kvmesh.ingress.core.sse import sse
from kvmesh.ingress.core.types import (
    GenerationRequest,
    Usage,
)
from kvmesh.ingress.dialects.common import (
    Run,
    finish_turn,
    generation_request,
    open_run,
    respond,
)
from kvmesh.ingress.dialects.openai.models import (
    ChatCompletionRequest,
    CompletionRequest,
    JsonObjectFormat,
    JsonSchemaResponseFormat,
    _Common,
)
from kvmesh.ingress.dialects.openai.output import (
    FINISH,
    ChatDeltas,
    chat_message,
    finish_reason,
)
from kvmesh.ingress.dialects.tool_choice import (
    ToolParsing,
    json_constraint,
    request_constraint,
    tool_parsing,
    tool_schemas,
)
from kvmesh.ingress.sessions.turn import Turn, inputs
from kvmesh.log import get_logger
from kvmesh.protocol.serving import Constraint, SamplingSpec
from kvmesh.sessions.outcome import ToolEvidence, tool_evidence

log = get_logger(__name__)
router = APIRouter()


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    state, _ = authenticated(request)
    return {"object": "list", "data": [{"id": state.model_id, "object": "model", "created": 0, "owned_by": "kvmesh"}]}


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Any:
    adm, body = await admit_as(request, ChatCompletionRequest)
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
    adm, body = await admit_as(request, CompletionRequest)
    given = inputs(adm, Dialect.OPENAI)
    prompt_ids = adm.state.prompts.encode(body.text())
    turn = adm.state.sessions.begin(adm, given, prompt_ids, ToolEvidence())
    req = _generation(adm, body, turn, body.max_tokens)
    return await _respond(adm, req, body, turn, chat=False)


def _generation(adm: Admitted, body: _Common, turn: Turn, max_tokens: int | None,
                constraint: Constraint | None = None) -> GenerationRequest:
    limit = budget(adm.state, len(turn.prompt_ids), max_tokens)
    sampling = SamplingSpec(max_tokens=limit, temperature=float(body.temperature), top_p=float(body.top_p),
                            seed=body.seed, stop=body.stop_list(), ignore_eos=body.ignore_eos,
                            constraint=constraint)
    if body.user or body.safety_identifier:
        log.info("request identity", user=body.user, safety_identifier=body.safety_identifier)
    return generation_request(adm, turn.prompt_ids, sampling, turn, cache_key=body.prompt_cache_key)


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


async def _respond(adm: Admitted, req: GenerationRequest, body: _Common, turn: Turn, chat: bool,
                   parsing: ToolParsing | None = None) -> Any:
    run = await open_run(adm, req, "chat" if chat else "completions")
    answer: dict[str, Any] = {}
    frames = _chunks(adm, req, body, turn, chat, run, ChatDeltas(parsing), parsing, answer)
    return await respond(run, frames, body.stream, turn.header(), lambda: answer,
                         lambda exc: sse(ApiError(exc.kind, exc.message).body(Dialect.OPENAI)))


async def _chunks(adm: Admitted, req: GenerationRequest, body: _Common, turn: Turn, chat: bool, run: Run,
                  deltas: ChatDeltas, parsing: ToolParsing | None, answer: dict[str, Any]) -> AsyncIterator[bytes]:
    """The chunks of a streamed answer; at the end `answer` holds the whole (non-streaming) response."""
    env = _envelope(req, body.model, chat, True)
    tail = {"usage": None} if body.include_usage else {}
    if chat:
        yield sse({**env, "choices": [_choice(True, None, None, first=True)], **tail})
    async for event in run.events():
        pieces = deltas.feed(event.text) if chat else [{"content": event.text}] if event.text else []
        if event.finished and chat:
            pieces += deltas.finish()
        for piece in pieces:
            choice = _delta(piece) if chat else _choice(False, piece["content"], None)
            yield sse({**env, "choices": [choice], **tail})
    out, usage = run.output, run.usage
    text = out.text
    # the whole message only where it is answered (non-streaming): a stream's calls are the ones it streamed
    message, parsed = chat_message(text, parsing) if chat and not body.stream else (None, [])
    called = deltas.called if body.stream else parsed
    yield sse({**env, "choices": [_choice(chat, None, finish_reason(out.finish, bool(called)))], **tail})
    if body.include_usage:
        yield sse({**env, "choices": [], "usage": _usage(usage, len(out.ids))})
    yield sse("[DONE]")
    finish_turn(adm, turn, run, text if chat else None, "tool_calls" if called else out.finish, called)
    if body.stream:
        return
    if chat:
        choice = {"index": 0, "message": message, "logprobs": None,
                  "finish_reason": finish_reason(out.finish, bool(called))}
    else:
        choice = _choice(False, text, out.finish)
    answer.update({**_envelope(req, body.model, chat, False), "choices": [choice],
                   "usage": _usage(usage, len(out.ids))})
