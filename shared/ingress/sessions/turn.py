"""A request's turn of its session: what the request names (`inputs`) and the turn `begin` opens.

`TurnRequest` is what the tracker reads of an admitted request (shared/ingress/admission/admit.py's
`Admitted` is one), so sessions depend on no route or state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from kvmesh.ingress.admission.auth import Principal
from kvmesh.ingress.core.errors import Dialect, invalid
from kvmesh.sessions.foreign_hints import foreign_hints
from kvmesh.sessions.identity import (
    SessionHints,
    SessionInputError,
    SessionRef,
    Source,
    explicit_anthropic,
    explicit_openai,
    hints,
    scoped_session_id,
)
from kvmesh.sessions.lineage import ParentRef, named_parent
from kvmesh.sessions.outcome import ToolEvidence


class TurnRequest(Protocol):
    """An admitted request, as far as sessions read it."""

    principal: Principal
    body: dict[str, Any]
    request_id: str
    headers: Mapping[str, str]
    path: str


@dataclass(frozen=True, slots=True)
class SessionInputs:
    explicit: tuple[Source, str] | None
    hints: SessionHints
    parent: ParentRef | None = None  # the parent session the request names (shared/sessions/lineage.py)


def inputs(adm: TurnRequest, dialect: Dialect) -> SessionInputs:
    """The session id the request names, its hints and its session's parent, kvmesh's own first, then vLLM's
    and Dynamo's (shared/sessions/foreign_hints.py); a malformed one is a 400 (nothing published)."""
    find = explicit_anthropic if dialect is Dialect.ANTHROPIC else explicit_openai
    try:
        foreign = foreign_hints(adm.headers, adm.body)
        return SessionInputs(find(adm.headers, adm.body), hints(adm.headers, adm.body, foreign),
                             named_parent(adm.headers, adm.body))
    except SessionInputError as exc:
        raise invalid(exc.message, param=exc.param) from None


@dataclass(slots=True)
class Turn:
    """One request's turn of its session, from `begin` to `finish`."""

    ref: SessionRef
    hints: SessionHints
    evidence: ToolEvidence
    request_id: str
    tenant_salt: str
    started_at: float
    prompt_ids: list[int]
    prompt_hashes: list[bytes]
    path: str = ""  # the route (the traffic record's api)
    started_mono: float = 0.0  # time.monotonic() at begin: the traffic record's TTFT counts from it
    parent: ParentRef | None = None  # the session this one was forked from (named or inferred)
    root: str = ""  # the client id of its group's root ("": the session is its own root)

    @property
    def session_id(self) -> str:
        return self.ref.session_id

    @property
    def parent_session_id(self) -> str | None:
        return None if self.parent is None else scoped_session_id(self.ref.tenant, self.parent.client_id)

    @property
    def group_session_id(self) -> str:
        """The scoped id of the session's group root: routing's affinity key, so the group shares a home."""
        return scoped_session_id(self.ref.tenant, self.root) if self.root else self.session_id

    def header(self) -> dict[str, str]:
        """The response header naming the session (an inferred one's id is how a client can end it)."""
        return {"x-session-id": self.ref.client_id}
