"""The OpenAI Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

A request's items (after its `previous_response_id`'s stored conversation,
with its own `instructions` first) become chat-template messages and run
like `/v1/chat/completions`: same prompt builder, same session tracker, same
gateway. Tool calls in the output become `function_call` items
(`responses_tools.py` splits them out of the text and builds the decoding
constraint for `tool_choice` and `text.format`). With `store` (default) the
response and its conversation go to the `responses` KV bucket
(`response_store.py`), and a follow-up continues the stored session.
Everything that can be wrong with a request is checked before a job is
published. A stream waits for the first token before answering 200, as the
chat route does; a failure after that is an `error` event.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from kvmesh.engine.chat_template import ChatTemplateError
from kvmesh.ingress.admission import (
    Admitted,
    IngressState,
    admit,
    budget,
    check_model,
    parse,
    state_of,
)
from kvmesh.ingress.errors import ApiError, Dialect, ErrorKind, invalid
from kvmesh.ingress.gateway import GatewayError, GenerationRequest, Usage, route_header
from kvmesh.ingress.openai_api import _account
from kvmesh.ingress.response_store import ResponseStore, StoredResponse
from kvmesh.ingress.responses_conversation import stored, to_messages
from kvmesh.ingress.responses_models import ResponsesRequest, items
from kvmesh.ingress.responses_output import EventWriter, ResponseDraft, new_id, usage_of
from kvmesh.ingress.responses_stream import OutputBuilder
from kvmesh.ingress.responses_tools import ToolPlan, plan_tools
from kvmesh.ingress.sessions import SessionInputs, Turn, inputs
from kvmesh.ingress.sse import SSE_HEADERS
from kvmesh.log import get_logger
from kvmesh.protocol.serving import SamplingSpec, TokenEvent
from kvmesh.sessions.identity import Source
from kvmesh.sessions.outcome import tool_evidence

log = get_logger(__name__)
router = APIRouter()

_STORE = "responses"


def store_of(state: IngressState) -> ResponseStore:
    store = state.extra.get(_STORE)
    if store is None:
        store = state.extra[_STORE] = ResponseStore(state.gateway.nc.jetstream())
    return store


def _not_found(response_id: str, param: str | None = None) -> ApiError:
    return ApiError(ErrorKind.NOT_FOUND, f"Response with id '{response_id}' not found.", param=param,
                    code="previous_response_not_found" if param else "response_not_found")


@dataclass(slots=True)
class _Prepared:
    """A validated request, ready to publish: nothing here has gone on the bus yet."""

    body: ResponsesRequest
    req: GenerationRequest
    turn: Turn
    plan: ToolPlan
    draft: ResponseDraft
    conversation: list[dict[str, Any]]  # stored history + this request's input items


async def _prepare(adm: Admitted) -> _Prepared:
    body = parse(ResponsesRequest, adm.body)
    check_model(adm.state, body.model)
    body.check_unsupported()
    new = items(body.input)
    given = inputs(adm, Dialect.OPENAI)
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        prev = await store_of(adm.state).get(adm.principal.tenant, body.previous_response_id)
        if prev is None:
            raise _not_found(body.previous_response_id, param="previous_response_id")
        history = prev.conversation
        if given.explicit is None or given.explicit[0] is not Source.HEADER:
            given = SessionInputs((Source.PREVIOUS_RESPONSE, prev.session), given.hints)
    plan = plan_tools(adm.state, body)
    messages = to_messages(body.instructions, items(history, param="previous_response_id"), new)
    try:
        prompt_ids = adm.state.prompts.chat(adm.principal.tenant, messages, plan.template_tools)
    except ChatTemplateError as exc:
        raise invalid(f"input: {exc}", param="input") from None
    try:
        limit = budget(adm.state, len(prompt_ids), body.max_output_tokens)
    except ApiError as exc:
        exc.param = "max_output_tokens" if exc.param == "max_tokens" else "input"
        raise
    turn = adm.state.sessions.begin(adm, given, prompt_ids, tool_evidence(messages, plan.template_tools))
    sampling = SamplingSpec(max_tokens=limit, temperature=1.0 if body.temperature is None else body.temperature,
                            top_p=1.0 if body.top_p is None else body.top_p, constraint=plan.constraint)
    req = GenerationRequest(
        request_id=adm.request_id, tenant=adm.principal.tenant, tenant_salt=adm.principal.salt,
        prompt_ids=prompt_ids, sampling=sampling, session_id=turn.session_id,
        affinity_key=body.prompt_cache_key or turn.session_id,
        block_hashes=turn.prompt_hashes if adm.state.sessions.hasher.named else None)
    draft = ResponseDraft(new_id("resp"), int(time.time()), body.model, body, plan.echo)
    return _Prepared(body, req, turn, plan, draft, [*history, *(stored(i) for i in new)])


@router.post("/v1/responses")
async def create_response(request: Request) -> Any:
    adm = await admit(request)
    p = await _prepare(adm)
    started = time.monotonic()
    usage = Usage()
    events = adm.state.gateway.stream(p.req, usage).__aiter__()
    try:
        first = await events.__anext__()  # GatewayError here is still an HTTP error status
    except BaseException:
        await events.aclose()  # type: ignore[attr-defined]
        raise
    adm.state.metrics.ttft_seconds.labels("responses").observe(usage.first_token_at - started)
    headers = {**route_header(usage), **p.turn.header()}
    frames = _run(adm, p, usage, first, events)
    if p.body.stream:
        return StreamingResponse(frames, media_type="text/event-stream", headers={**SSE_HEADERS, **headers})
    async for _ in frames:  # the same run, frames dropped: both modes build the same response
        pass
    return JSONResponse(p.draft.final, headers=headers)


async def _run(adm: Admitted, p: _Prepared, usage: Usage, first: TokenEvent,
               events: AsyncIterator[TokenEvent]) -> AsyncIterator[bytes]:
    """The response's SSE frames, from `response.created` to `response.completed` (or `.incomplete`);
    on the way the output is built, the turn finished and the response stored."""
    write = EventWriter()
    draft = p.draft
    out = OutputBuilder(draft.output, write)
    split = p.plan.splitter(p.body.stream)
    ids: list[int] = []
    try:
        yield write("response.created", response=draft.envelope("in_progress"))
        yield write("response.in_progress", response=draft.envelope("in_progress"))
        event = first
        while True:
            ids += event.token_ids
            split.feed(event.text, out)
            for frame in out.take():
                yield frame
            if event.finished:
                break
            event = await events.__anext__()
        finish = event.finish_reason or "stop"
        split.finish(out)
        out.finish("incomplete" if finish == "length" else "completed")
        for frame in out.take():
            yield frame
        status = "incomplete" if finish == "length" else "completed"
        draft.final = draft.envelope(status, usage_of(usage, len(ids), adm.state.sessions.hasher.block_size),
                                     "max_output_tokens" if status == "incomplete" else None)
        _finish_turn(adm, p, usage, ids, out)
        await _save(adm, p)
        yield write(f"response.{status}", response=draft.final)
    except GatewayError as exc:
        log.warning("response stream ended with an error", error=exc.message)
        body = ApiError(exc.kind, exc.message).body(Dialect.OPENAI)["error"]
        yield write("error", code=body["code"], message=body["message"], param=body["param"])
        if not p.body.stream:
            raise
    finally:
        await events.aclose()  # type: ignore[attr-defined]


def _finish_turn(adm: Admitted, p: _Prepared, usage: Usage, ids: list[int], out: OutputBuilder) -> None:
    _account(adm, usage, len(ids))
    answer = None
    if not out.calls:
        answer = adm.state.prompts.remember_answer(p.req.tenant, out.text, ids)
    finish = "tool_calls" if out.calls else None
    adm.state.sessions.finish(p.turn, ids, answer, finish, usage.prefill_worker or usage.finished_by,
                              [c.name for c in out.calls], usage=usage)


async def _save(adm: Admitted, p: _Prepared) -> None:
    """Store the response and its conversation (`store`); a bus that will not take it costs the follow-up
    (logged), never this response."""
    if not p.body.store:
        return
    now = time.time()
    entry = StoredResponse(id=p.draft.id, tenant=adm.principal.tenant, session=p.turn.ref.client_id,
                           created_at=now, expires_at=now + adm.state.settings.response_retention_s,
                           response=p.draft.final, conversation=[*p.conversation, *p.draft.output])
    try:
        await store_of(adm.state).put(entry)
    except Exception as exc:  # noqa: BLE001 - the answer is already made; only its continuation is lost
        log.warning("response not stored", response_id=p.draft.id, error=repr(exc))


@router.get("/v1/responses/{response_id}")
async def get_response(request: Request, response_id: str) -> Any:
    state = state_of(request)
    principal = state.keyring.authenticate(request)
    entry = await store_of(state).get(principal.tenant, response_id)
    if entry is None:
        raise _not_found(response_id)
    return entry.response


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str) -> Any:
    state = state_of(request)
    principal = state.keyring.authenticate(request)
    if not await store_of(state).delete(principal.tenant, response_id):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}
