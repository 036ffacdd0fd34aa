"""A session's parent: the session a sub-agent was forked from, as the client names it.

An agent harness starts sub-agents that share the parent's prefix (its system
prompt and tools, often its whole history so far) and report back to it.
Knowing the parent lets the fleet treat them as one group: retention keeps
the prefix they share while any of them is active
(shared/eviction/session_groups.py) and routing sends the whole group to
the root's home worker. A request names its session's parent, first present
wins:

1. the `x-kvmesh-parent-session-id` header;
2. the body extension `"kvmesh": {"parent_session_id": "..."}`;
3. NVIDIA Dynamo's `x-dynamo-parent-session-id` header.

The chosen value is checked as a session id is (1-256 printable characters;
empty or blank counts as absent): a bad one is a `SessionInputError`, a 400
before anything is published. A value that loses on precedence is not
checked here (Dynamo's header is checked whole with the other foreign hints,
shared/sessions/foreign_hints.py). Like a session id, the parent is the
client's id, scoped to the tenant on the wire. A request that names no
parent may still get one: the ingress infers it from a shared chain
(shared/ingress/sessions/forks.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from kvmesh.sessions.foreign_hints import HDR_DYNAMO_PARENT
from kvmesh.sessions.identity import BODY_EXTENSION, SessionInputError, check_id

HDR_PARENT = "x-kvmesh-parent-session-id"
EXTENSION_FIELD = "parent_session_id"  # in the `kvmesh` body extension


class ParentSource(StrEnum):
    """Where a session's parent came from (a metric label: a bounded set)."""

    HEADER = HDR_PARENT
    BODY = f"{BODY_EXTENSION}.{EXTENSION_FIELD}"
    DYNAMO_HEADER = HDR_DYNAMO_PARENT
    INFERRED = "inferred"  # the session's first prompt runs deep into another session's chain


@dataclass(frozen=True, slots=True)
class ParentRef:
    """The parent of a request's session: its id as the client knows it, and where that came from."""

    client_id: str
    source: ParentSource


def named_parent(headers: Mapping[str, str], body: Mapping[str, Any]) -> ParentRef | None:
    """The parent the request names, by the precedence in the module docstring; None: it names none.
    The `kvmesh` extension's own shape (an object of known fields) is checked by `identity.hints`."""
    ext = body.get(BODY_EXTENSION)
    in_body = ext.get(EXTENSION_FIELD) if isinstance(ext, Mapping) else None
    for source, value in ((ParentSource.HEADER, headers.get(HDR_PARENT)),
                          (ParentSource.BODY, in_body),
                          (ParentSource.DYNAMO_HEADER, headers.get(HDR_DYNAMO_PARENT))):
        if value is None or (isinstance(value, str) and not value.strip()):
            continue
        if not isinstance(value, str):
            raise SessionInputError(f"{source.value}: a session id must be a string", source.value)
        return ParentRef(check_id(value, source.value), source)
    return None
