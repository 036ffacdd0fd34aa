"""The Anthropic dialect: POST /v1/messages, as the official `anthropic` SDK speaks it.

Auth by `x-api-key` (a Bearer token works too); `anthropic-version` is
accepted and not checked. The response is a `message` object with a text
block and any `tool_use` blocks parsed from the output (output.py;
tool_choice any/tool forces them), `stop_reason` (`end_turn` / `tool_use` /
`max_tokens` / `stop_sequence` with the matched `stop_sequence`) and
Anthropic's cache usage (see cache_control.py).
A stream waits for its first token before answering 200, so early failures
are error statuses (overload: 529); a failure after that is an `error`
event and the stream never reaches `message_stop`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from kvmesh.engine.chat_template import ChatTemplateError
from kvmesh.ingress.admission.admit import (
    Admitted,
    admit_as,
    budget,
)
from kvmesh.ingress.admission.pins import admit_pins, prompt_hashes
from kvmesh.ingress.core.errors import ApiError, Dialect, ErrorKind, invalid
from kvmesh.ingress.core.prompt import PromptBuilder
from kvmesh.ingress.core.sse import sse
from kvmesh.ingress.core.types import (
    GenerationRequest,
    Usage,
)
from kvmesh.ingress.dialects.anthropic.cache_control import (
    CacheUsage,
    Conversation,
    Placed,
    cache_usage,
    check_breakpoints,
    pins,
    place,
)
from kvmesh.ingress.dialects.anthropic.models import CountTokensRequest, MessagesRequest
from kvmesh.ingress.dialects.anthropic.output import (
    BlockEvents,
    content_blocks,
    stop_reason_with_calls,
)
from kvmesh.ingress.dialects.common import (
    Run,
    finish_turn,
    generation_request,
    open_run,
    respond,
)
from kvmesh.ingress.dialects.tool_choice import (
    ToolParsing,
    request_constraint,
    tool_parsing,
    tool_schemas,
)
from kvmesh.ingress.sessions.turn import SessionInputs, Turn, inputs
from kvmesh.log import get_logger
from kvmesh.protocol.serving import SamplingSpec
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
    limit = budget(adm.state, len(ids), body.max_tokens)
    schemas = tool_schemas(conv.tools)
    choice, parallel = body.choice(bool(schemas))
    constraint = request_constraint(schemas, choice, adm.state.tool_format, parallel, None, "")
    sampling = SamplingSpec(max_tokens=limit, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                            stop=body.stops(), constraint=constraint)
    turn = adm.state.sessions.begin(adm, given, ids, tool_evidence(conv.messages, conv.tools))
    req = generation_request(adm, ids, sampling, turn, pins=pins(placed))
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
    adm, body = await admit_as(request, CountTokensRequest)
    ids, _, _ = _prompt(adm, body, await named_prefix(adm, body.cache_id))
    return {"input_tokens": len(ids)}


@router.post("/v1/messages")
async def messages(request: Request) -> Any:
    adm, body = await admit_as(request, MessagesRequest)
    given = inputs(adm, Dialect.ANTHROPIC)
    req, placed, turn, parsing = _build(adm, body, await named_prefix(adm, body.cache_id), given)
    if req.pins:  # breakpoints: the tenant's pin budget is checked before the job is queued (429 past it)
        await admit_pins(adm, req.pins, prompt_hashes(adm.state, req.prompt_ids, req.tenant_salt, req.block_hashes))
    run = await open_run(adm, req, "messages")
    answer: dict[str, Any] = {}
    frames = _events(adm, req, body, placed, turn, run, BlockEvents(parsing), parsing, answer)
    return await respond(run, frames, body.stream, turn.header(), lambda: answer,
                         lambda exc: sse(ApiError(exc.kind, exc.message).body(Dialect.ANTHROPIC), "error"))


async def _events(adm: Admitted, req: GenerationRequest, body: MessagesRequest, placed: list[Placed], turn: Turn,
                  run: Run, blocks: BlockEvents, parsing: ToolParsing | None, answer: dict[str, Any]
                  ) -> AsyncIterator[bytes]:
    """The events of a streamed message; at the end `answer` holds the whole (non-streaming) message."""
    start = _message(req, body.model, [], (None, None), _cache_usage(run.usage, placed).to_dict(1))
    yield sse({"type": "message_start", "message": start}, "message_start")
    async for event in run.events():
        for name, data in blocks.feed(event.text):
            yield sse(data, name)
    for name, data in blocks.finish():
        yield sse(data, name)
    out = run.output
    content, called = content_blocks(out.text, parsing) if not body.stream else ([], blocks.called)
    reason = stop_reason(out.finish, out.text, adm.state.prompts.tokenizer.decode(out.ids), body.stops())
    reason = (stop_reason_with_calls(reason[0], bool(called)), reason[1])
    yield sse({"type": "message_delta", "delta": {"stop_reason": reason[0], "stop_sequence": reason[1]},
               "usage": {"output_tokens": len(out.ids)}}, "message_delta")
    yield sse({"type": "message_stop"}, "message_stop")
    finish_turn(adm, turn, run, out.text, reason[0], called)
    if not body.stream:
        answer.update(_message(req, body.model, content, reason,
                               _cache_usage(run.usage, placed).to_dict(len(out.ids))))
