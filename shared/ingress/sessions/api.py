"""POST /v1/sessions/{session_id}/end: the client says a session is over.

Authenticated like every route (Bearer or `x-api-key`); the id is the
client's (as sent in `x-session-id` / a body field, or as an inferred
session's `x-session-id` response header) and is scoped to the caller's
tenant, so a tenant can end only its own sessions. The ingress publishes one
`ended` SessionEvent (eviction demotes the session's unshared blocks first)
and forgets the session's chain, so a later request extending it starts a new
session. Idempotent: ending twice is one event (same Nats-Msg-Id within the
stream's duplicate window) and always 200, also for a session this replica
never served (another replica may have). Errors use the OpenAI format.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from kvmesh.bus.publish import PublishError
from kvmesh.ingress.admission.admit import authenticated
from kvmesh.ingress.core.errors import ApiError, ErrorKind, invalid
from kvmesh.log import bind_request
from kvmesh.sessions.identity import SessionInputError, check_id, scoped_session_id

router = APIRouter()


@router.post("/v1/sessions/{session_id}/end")
async def end_session(session_id: str, request: Request) -> dict[str, Any]:
    state, principal = authenticated(request)
    state.limiter.check(principal.key_id)
    try:
        client_id = check_id(session_id, "session_id")
    except SessionInputError as exc:
        raise invalid(exc.message, param=exc.param) from None
    scoped = scoped_session_id(principal.tenant, client_id)
    with bind_request(session_id=client_id, scoped_session_id=scoped):
        try:
            event = await state.sessions.end(principal.tenant, principal.salt, client_id)
        except PublishError as exc:
            raise ApiError(ErrorKind.OVERLOADED, f"the session end could not be recorded: {exc}",
                           retry_after_s=1.0) from None
    return {"id": client_id, "object": "session", "status": "ended", "ended_at": event.at}
