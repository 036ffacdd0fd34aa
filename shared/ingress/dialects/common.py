"""The request path every dialect shares: build the request, run it, finish the turn, answer.

A dialect route validates its body, then:
1. `generation_request(...)`: the one place a `GenerationRequest` is built
   (ids and salt from admission, session, affinity and block hashes from the turn);
2. `open_run(adm, req, route)`: starts the gateway's stream and waits for the
   first token, so a failure before it is still an HTTP error status;
3. a frames generator of its own over `Run.events()`, which ends by calling
   `finish_turn(...)`: the one place a turn is accounted, its answer remembered
   and its session told;
4. `respond(...)`: a stream sends the frames; a non-streaming request runs the
   same frames to the end and answers the object they built. One path, so both
   modes give the same answer. A failure after the first token ends a stream with
   the dialect's error frame, and a non-streaming request with its error status.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from kvmesh.ingress.admission.admit import Admitted
from kvmesh.ingress.core.sse import SSE_HEADERS
from kvmesh.ingress.core.types import (
    GatewayError,
    GenerationRequest,
    Usage,
    route_header,
)
from kvmesh.ingress.sessions.turn import Turn
from kvmesh.log import get_logger
from kvmesh.protocol.serving import CachePin, SamplingSpec, TokenEvent

log = get_logger(__name__)


def generation_request(adm: Admitted, prompt_ids: list[int], sampling: SamplingSpec, turn: Turn | None = None,
                       cache_key: str | None = None, pins: Sequence[CachePin] = (),
                       prefill_only: bool = False) -> GenerationRequest:
    """The request a dialect hands the gateway. With a `turn` it runs in the turn's session, routed by
    `cache_key` (prompt_cache_key) or else the session's group root (a forked session goes where its root,
    and so the prefix they share, lives); without one (named-cache creation) in the `x-session-id`
    header's session, routed by load."""
    session = turn.session_id if turn is not None else adm.session_id
    named = turn is not None and adm.state.sessions.hasher.named
    return GenerationRequest(
        request_id=adm.request_id, tenant=adm.principal.tenant, tenant_salt=adm.principal.salt,
        prompt_ids=prompt_ids, sampling=sampling, session_id=session,
        affinity_key=(cache_key or turn.group_session_id) if turn is not None else None, pins=list(pins),
        prefill_only=prefill_only, block_hashes=turn.prompt_hashes if named else None,
        on_dispatched=(lambda: adm.state.sessions.announce(turn)) if turn is not None else None,
    )


@dataclass(slots=True)
class Output:
    """What a run delivered so far: its token ids, their text, and how it finished."""

    ids: list[int] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    finish: str = ""  # the final event's finish_reason ("stop" if it named none)

    @property
    def text(self) -> str:
        return "".join(self.pieces)


class Run:
    """A started request: its usage (filled as events arrive) and its events, the first already here."""

    def __init__(self, usage: Usage, first: TokenEvent, rest: AsyncIterator[TokenEvent]) -> None:
        self.usage, self._first, self._rest = usage, first, rest
        self.output = Output()

    async def events(self) -> AsyncIterator[TokenEvent]:
        """Every event up to the finished one; each is added to `output` before it is yielded."""
        event = self._first
        while True:
            self.output.ids += event.token_ids
            self.output.pieces.append(event.text)
            if event.finished:
                self.output.finish = event.finish_reason or "stop"
            yield event
            if event.finished:
                return
            event = await self._rest.__anext__()

    async def close(self) -> None:
        await self._rest.aclose()  # type: ignore[attr-defined]


async def open_run(adm: Admitted, req: GenerationRequest, route: str) -> Run:
    """Publish `req` and wait for its first token (raises GatewayError: an error status); TTFT is counted."""
    started = time.monotonic()
    usage = Usage()
    events = adm.state.gateway.stream(req, usage).__aiter__()
    try:
        first = await events.__anext__()
    except BaseException:
        await events.aclose()  # type: ignore[attr-defined]
        raise
    adm.state.metrics.ttft_seconds.labels(route).observe(usage.first_token_at - started)
    return Run(usage, first, events)


def finish_turn(adm: Admitted, turn: Turn, run: Run, answer: str | None, finish: str | None,
                called: Sequence[str] = ()) -> None:
    """The turn is delivered: log and count it, remember `answer` (the text of a chat answer, which the next
    turn's prompt will quote; None: nothing to remember), and tell the session how it ended (`finish`, the
    tools `called`)."""
    usage, out = run.usage, run.output
    log.info("request finished", tenant=adm.principal.tenant, prompt_tokens=usage.prompt_tokens,
             cached_tokens=usage.cached_tokens, completion_tokens=len(out.ids), attempts=usage.attempts,
             prefill_worker=usage.prefill_worker, decode_worker=usage.decode_worker)
    m = adm.state.metrics
    m.prompt_tokens.inc(usage.prompt_tokens)
    m.cached_tokens.inc(usage.cached_tokens)
    m.completion_tokens.inc(len(out.ids))
    remembered = None if answer is None else adm.state.prompts.remember_answer(adm.principal.tenant, answer, out.ids)
    adm.state.sessions.finish(turn, out.ids, remembered, finish, usage.prefill_worker or usage.finished_by, called,
                              usage=usage)


async def respond(run: Run, frames: AsyncIterator[bytes], stream: bool, headers: dict[str, str],
                  result: Callable[[], Any], error_frame: Callable[[GatewayError], bytes]) -> Any:
    """Send `frames` (stream), or run them to the end and answer `result()`, the object they built."""
    delivered = _delivered(run, frames, stream, error_frame)
    if stream:  # the route header names the workers as of the first token
        return StreamingResponse(delivered, media_type="text/event-stream",
                                 headers={**SSE_HEADERS, **route_header(run.usage), **headers})
    async for _ in delivered:
        pass
    return JSONResponse(result(), headers={**route_header(run.usage), **headers})


async def _delivered(run: Run, frames: AsyncIterator[bytes], stream: bool,
                     error_frame: Callable[[GatewayError], bytes]) -> AsyncIterator[bytes]:
    try:
        async for frame in frames:
            yield frame
    except GatewayError as exc:
        if not stream:
            raise  # the app renders it as the dialect's error status
        log.warning("stream ended with an error", error=exc.message)
        yield error_frame(exc)
    finally:
        await frames.aclose()  # type: ignore[attr-defined]
        await run.close()
