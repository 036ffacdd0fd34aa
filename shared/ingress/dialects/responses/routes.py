"""The OpenAI Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

A request's items (after its `previous_response_id`'s stored conversation,
with its own `instructions` first) become chat-template messages and run
like `/v1/chat/completions`: same prompt builder, same session tracker, same
gateway. Tool calls in the output become `function_call` items
(`tools.py` splits them out of the text and builds the decoding
constraint for `tool_choice` and `text.format`). With `store` (default) the
response and its conversation go to the `responses` KV bucket
(`store.py`), and a follow-up continues the stored session.
Everything that can be wrong with a request is checked before a job is
published. A stream waits for the first token before answering 200, as the
chat route does; a failure after that is an `error` event.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
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
from kvmesh.ingress.core.state import IngressState
from kvmesh.ingress.core.types import (
    GatewayError,
    GenerationRequest,
)
from kvmesh.ingress.dialects.common import (
    Run,
    finish_turn,
    generation_request,
    open_run,
    respond,
)
from kvmesh.ingress.dialects.responses.conversation import stored, to_messages
from kvmesh.ingress.dialects.responses.models import ResponsesRequest, items
from kvmesh.ingress.dialects.responses.output import (
    EventWriter,
    ResponseDraft,
    new_id,
    usage_of,
)
from kvmesh.ingress.dialects.responses.store import ResponseStore, StoredResponse
from kvmesh.ingress.dialects.responses.stream import OutputBuilder
from kvmesh.ingress.dialects.responses.tools import ToolPlan, plan_tools
from kvmesh.ingress.sessions.turn import Turn, inputs
from kvmesh.log import get_logger
from kvmesh.protocol.serving import SamplingSpec
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


async def _prepare(adm: Admitted, body: ResponsesRequest) -> _Prepared:
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
            given = replace(given, explicit=(Source.PREVIOUS_RESPONSE, prev.session))
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
    req = generation_request(adm, prompt_ids, sampling, turn, cache_key=body.prompt_cache_key)
    draft = ResponseDraft(new_id("resp"), int(time.time()), body.model, body, plan.echo)
    return _Prepared(body, req, turn, plan, draft, [*history, *(stored(i) for i in new)])


@router.post("/v1/responses")
async def create_response(request: Request) -> Any:
    adm, body = await admit_as(request, ResponsesRequest)
    p = await _prepare(adm, body)
    run = await open_run(adm, p.req, "responses")
    write = EventWriter()
    return await respond(run, _run(adm, p, run, write), p.body.stream, p.turn.header(), lambda: p.draft.final,
                         lambda exc: _error_frame(write, exc))


def _error_frame(write: EventWriter, exc: GatewayError) -> bytes:
    body = ApiError(exc.kind, exc.message).body(Dialect.OPENAI)["error"]
    return write("error", code=body["code"], message=body["message"], param=body["param"])


async def _run(adm: Admitted, p: _Prepared, run: Run, write: EventWriter) -> AsyncIterator[bytes]:
    """The response's SSE frames, from `response.created` to `response.completed` (or `.incomplete`);
    on the way the output is built, the turn finished and the response stored."""
    draft = p.draft
    out = OutputBuilder(draft.output, write)
    split = p.plan.splitter(p.body.stream)
    yield write("response.created", response=draft.envelope("in_progress"))
    yield write("response.in_progress", response=draft.envelope("in_progress"))
    async for event in run.events():
        split.feed(event.text, out)
        for frame in out.take():
            yield frame
    status = "incomplete" if run.output.finish == "length" else "completed"
    split.finish(out)
    out.finish(status)
    for frame in out.take():
        yield frame
    draft.final = draft.envelope(status, usage_of(run.usage, len(run.output.ids), adm.state.sessions.hasher.block_size),
                                 "max_output_tokens" if status == "incomplete" else None)
    calls = [c.name for c in out.calls]
    finish_turn(adm, p.turn, run, None if calls else out.text, "tool_calls" if calls else None, calls)
    await _save(adm, p)
    yield write(f"response.{status}", response=draft.final)


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
    state, principal = authenticated(request)
    entry = await store_of(state).get(principal.tenant, response_id)
    if entry is None:
        raise _not_found(response_id)
    return entry.response


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str) -> Any:
    state, principal = authenticated(request)
    if not await store_of(state).delete(principal.tenant, response_id):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}
