"""The Anthropic dialect: POST /v1/messages, as the official `anthropic` SDK speaks it.

Auth by `x-api-key` (a Bearer token works too); `anthropic-version` is
accepted and not checked. The response is a `message` object with a text
block and any `tool_use` blocks parsed from the output (anthropic_output.py;
tool_choice any/tool forces them), `stop_reason` (`end_turn` / `tool_use` /
`max_tokens` / `stop_sequence` with the matched `stop_sequence`) and
Anthropic's cache usage (see cache_control.py).
A stream waits for its first token before answering 200, so early failures
are error statuses (overload: 529); a failure after that is an `error`
event and the stream never reaches `message_stop`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from kvmesh.engine.chat_template import ChatTemplateError
from kvmesh.ingress.admission import Admitted, admit, budget, check_model, parse
from kvmesh.ingress.anthropic_models import CountTokensRequest, MessagesRequest
from kvmesh.ingress.anthropic_output import (
    BlockEvents,
    content_blocks,
    stop_reason_with_calls,
)
from kvmesh.ingress.cache_control import (
    CacheUsage,
    Conversation,
    Placed,
    cache_usage,
    check_breakpoints,
    pins,
    place,
)
from kvmesh.ingress.errors import ApiError, Dialect, ErrorKind, invalid
from kvmesh.ingress.gateway import GatewayError, GenerationRequest, Usage, route_header
from kvmesh.ingress.openai_api import (
    _account,  # one place logs and counts a finished request
)
from kvmesh.ingress.pin_admission import admit_pins, prompt_hashes
from kvmesh.ingress.prompt import PromptBuilder
from kvmesh.ingress.sessions import SessionInputs, Turn, inputs
from kvmesh.ingress.sse import SSE_HEADERS, sse
from kvmesh.ingress.tool_choice import (
    ToolParsing,
    request_constraint,
    tool_parsing,
    tool_schemas,
)
from kvmesh.log import get_logger
from kvmesh.protocol.serving import SamplingSpec, TokenEvent
from kvmesh.sessions.outcome import tool_evidence

log = get_logger(__name__)
router = APIRouter()


async def named_prefix(adm: Admitted, cache_id: str | None) -> Conversation | None:
    """The named cache's conversation (404 if unknown to this tenant or expired), or None."""
    if cache_id is None:
        return None
    if adm.state.cache_lookup is None:
        raise ApiError(ErrorKind.NOT_FOUND, "named caches are not enabled", param="cache_id")
    cached = await adm.state.cache_lookup(adm.principal, cache_id)
    return Conversation(list(cached.messages), list(cached.tools) if cached.tools else None)


def _prompt(adm: Admitted, body: MessagesRequest, prefix: Conversation | None
            ) -> tuple[list[int], list[Placed], Conversation]:
    """Prompt ids, placed breakpoints and the flat conversation; 400 for a bad conversation or breakpoints."""
    prompts, tenant = adm.state.prompts, adm.principal.tenant
    try:
        conv, breakpoints = body.conversation(prefix)
    except ValueError as exc:
        raise invalid(str(exc), param="system") from None
    check_breakpoints(breakpoints)
    try:
        rendered = render_prompt(prompts, conv)
        ids = prompts.tokenize(tenant, rendered, conv.messages)
        placed = place(prompts, tenant, conv, rendered, ids, breakpoints)
    except ChatTemplateError as exc:
        raise invalid(f"messages: {exc}", param="messages") from None
    return ids, placed, conv


def _build(adm: Admitted, body: MessagesRequest, prefix: Conversation | None, given: SessionInputs
           ) -> tuple[GenerationRequest, list[Placed], Turn, ToolParsing | None]:
    ids, placed, conv = _prompt(adm, body, prefix)
    tenant = adm.principal.tenant
    limit = budget(adm.state, len(ids), body.max_tokens)
    schemas = tool_schemas(conv.tools)
    choice, parallel = body.choice(bool(schemas))
    constraint = request_constraint(schemas, choice, adm.state.tool_format, parallel, None, "")
    sampling = SamplingSpec(max_tokens=limit, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                            stop=body.stops(), constraint=constraint)
    turn = adm.state.sessions.begin(adm, given, ids, tool_evidence(conv.messages, conv.tools))
    hashes = turn.prompt_hashes if adm.state.sessions.hasher.named else None
    req = GenerationRequest(request_id=adm.request_id, tenant=tenant, tenant_salt=adm.principal.salt,
                            prompt_ids=ids, sampling=sampling, session_id=turn.session_id,
                            affinity_key=turn.session_id, pins=pins(placed), block_hashes=hashes)
    return req, placed, turn, tool_parsing(schemas, choice, adm.state.tool_format)


def render_prompt(prompts: PromptBuilder, conv: Conversation) -> str:
    """The prompt text; a last assistant message is a prefill: the answer continues its text."""
    last = conv.messages[-1]
    if last["role"] != "assistant":
        return prompts.render(conv.messages, conv.tools)
    if last["content"] != last["content"].rstrip():
        raise invalid("messages: final assistant content cannot end with trailing whitespace", param="messages")
    return prompts.render(conv.messages[:-1], conv.tools) + last["content"]


def stop_reason(finish: str, text: str, full_text: str, stops: list[str]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): `full_text` decodes every generated id, stop string included."""
    if finish == "length":
        return "max_tokens", None
    found = [(full_text.find(s, max(0, len(text) - len(s))), s) for s in stops]
    found = [(at, s) for at, s in found if at >= 0]
    if finish == "stop" and found:
        return "stop_sequence", min(found)[1]
    return "end_turn", None


def _message_id(req: GenerationRequest) -> str:
    return "msg_" + req.request_id.removeprefix("req_")


def _message(req: GenerationRequest, model: str, content: list[dict[str, Any]],
             reason: tuple[str | None, str | None], usage: dict[str, Any]) -> dict[str, Any]:
    return {"id": _message_id(req), "type": "message", "role": "assistant", "content": content, "model": model,
            "stop_reason": reason[0], "stop_sequence": reason[1], "usage": usage}


def _cache_usage(usage: Usage, placed: list[Placed]) -> CacheUsage:
    return cache_usage(usage.prompt_tokens, usage.cached_tokens, placed)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> Any:
    """The prompt's token count as /v1/messages would build it (nothing runs)."""
    adm = await admit(request)
    body = parse(CountTokensRequest, adm.body)
    check_model(adm.state, body.model)
    ids, _, _ = _prompt(adm, body, await named_prefix(adm, body.cache_id))
    return {"input_tokens": len(ids)}


@router.post("/v1/messages")
async def messages(request: Request) -> Any:
    adm = await admit(request)
    body = parse(MessagesRequest, adm.body)
    check_model(adm.state, body.model)
    given = inputs(adm, Dialect.ANTHROPIC)
    req, placed, turn, parsing = _build(adm, body, await named_prefix(adm, body.cache_id), given)
    if req.pins:  # breakpoints: the tenant's pin budget is checked before the job is queued (429 past it)
        await admit_pins(adm, req.pins, prompt_hashes(adm.state, req.prompt_ids, req.tenant_salt, req.block_hashes))
    started = time.monotonic()
    if not body.stream:
        done = await adm.state.gateway.complete(req)
        usage = done.usage
        adm.state.metrics.ttft_seconds.labels("messages").observe(usage.first_token_at - started)
        _account(adm, usage, len(done.token_ids))
        answer = adm.state.prompts.remember_answer(req.tenant, done.text, done.token_ids)
        full = adm.state.prompts.tokenizer.decode(done.token_ids)
        blocks, called = content_blocks(done.text, parsing)
        reason = stop_reason(done.finish_reason, done.text, full, body.stops())
        reason = (stop_reason_with_calls(reason[0], bool(called)), reason[1])
        adm.state.sessions.finish(turn, done.token_ids, answer, reason[0], usage.prefill_worker or usage.finished_by,
                                  called, usage=usage)
        cu = _cache_usage(usage, placed).to_dict(len(done.token_ids))
        return JSONResponse(_message(req, body.model, blocks, reason, cu),
                            headers={**route_header(usage), **turn.header()})

    usage = Usage()
    events = adm.state.gateway.stream(req, usage).__aiter__()
    first = await events.__anext__()  # GatewayError here is still an HTTP error status
    adm.state.metrics.ttft_seconds.labels("messages").observe(usage.first_token_at - started)
    return StreamingResponse(_events(adm, req, body, placed, turn, usage, first, events, BlockEvents(parsing)),
                             media_type="text/event-stream",
                             headers={**SSE_HEADERS, **route_header(usage), **turn.header()})


async def _events(adm: Admitted, req: GenerationRequest, body: MessagesRequest, placed: list[Placed], turn: Turn,
                  usage: Usage, first: TokenEvent, events: AsyncIterator[TokenEvent], blocks: BlockEvents
                  ) -> AsyncIterator[bytes]:
    ids: list[int] = []
    text: list[str] = []
    try:
        start = _message(req, body.model, [], (None, None), _cache_usage(usage, placed).to_dict(1))
        yield sse({"type": "message_start", "message": start}, "message_start")
        event = first
        while True:
            ids += event.token_ids
            text.append(event.text)
            for name, data in blocks.feed(event.text):
                yield sse(data, name)
            if event.finished:
                break
            event = await events.__anext__()
        for name, data in blocks.finish():
            yield sse(data, name)
        joined = "".join(text)
        reason = stop_reason(event.finish_reason or "stop", joined, adm.state.prompts.tokenizer.decode(ids),
                             body.stops())
        reason = (stop_reason_with_calls(reason[0], bool(blocks.called)), reason[1])
        yield sse({"type": "message_delta", "delta": {"stop_reason": reason[0], "stop_sequence": reason[1]},
                   "usage": {"output_tokens": len(ids)}}, "message_delta")
        yield sse({"type": "message_stop"}, "message_stop")
        _account(adm, usage, len(ids))
        answer = adm.state.prompts.remember_answer(req.tenant, joined, ids)
        adm.state.sessions.finish(turn, ids, answer, reason[0], usage.prefill_worker or usage.finished_by,
                                  blocks.called, usage=usage)
    except GatewayError as exc:
        log.warning("stream ended with an error", error=exc.message)
        yield sse(ApiError(exc.kind, exc.message).body(Dialect.ANTHROPIC), "error")
    finally:
        await events.aclose()  # type: ignore[attr-defined]
