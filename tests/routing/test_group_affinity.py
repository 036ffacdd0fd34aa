"""Forked sessions route as one group: a sub-agent's request goes to its root's home worker.

The real tracker builds the turns, `generation_request` their affinity keys,
and the real `Router` picks among prefill workers fed real heartbeats, none
of which holds the prompt (so only the affinity home breaks the tie).
"""

from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace

from kvmesh.cache_index.messages import LookupReply
from kvmesh.config import IngressSettings
from kvmesh.ingress.admission.admit import Admitted
from kvmesh.ingress.admission.auth import Principal
from kvmesh.ingress.core.metrics import IngressMetrics
from kvmesh.ingress.dialects.common import generation_request
from kvmesh.ingress.routing.router import Router, home
from kvmesh.ingress.routing.workers import WorkerTable
from kvmesh.ingress.sessions.table import SessionTable
from kvmesh.ingress.sessions.tracker import ChainHasher, SessionTracker
from kvmesh.ingress.sessions.turn import SessionInputs, Turn
from kvmesh.protocol.messages import Heartbeat, Role
from kvmesh.protocol.serving import SamplingSpec
from kvmesh.service.watch import Change, WorkerChange
from kvmesh.sessions.identity import SessionHints, Source, scoped_session_id
from kvmesh.sessions.lineage import ParentRef, ParentSource
from kvmesh.sessions.outcome import ToolEvidence
from prometheus_client import CollectorRegistry

BLOCK = 16
WORKERS = [f"prefill-{i}" for i in range(8)]
NOBODY_HOLDS_IT = LookupReply(workers=[], l3_blocks=0, indexed_blocks=0, ready=True)


def fleet() -> Router:
    table = WorkerTable()
    for w in WORKERS:
        hb = Heartbeat(worker_id=w, role=Role.PREFILL, load=0.0, capacity=8, started_at=datetime.now(UTC),
                       http_endpoint="http://127.0.0.1:1", seq=0, ttl_s=30)
        table.apply(WorkerChange(Change.UP, w, hb))
    return Router.of(table, IngressSettings())


def request(tracker: SessionTracker, n: int, session: str, parent: str | None = None,
            body: dict | None = None) -> tuple[Turn, str | None]:
    """The turn and the affinity key of a request of `session` (naming `parent`)."""
    principal = Principal("k", "t", "00")
    adm = Admitted(SimpleNamespace(sessions=tracker), principal, body or {}, f"req_{n}", None)  # type: ignore[arg-type]
    named = None if parent is None else ParentRef(parent, ParentSource.HEADER)
    prompt = [100 + n] * (3 * BLOCK)
    turn = tracker.begin(adm, SessionInputs((Source.HEADER, session), SessionHints(), named), prompt, ToolEvidence())
    req = generation_request(adm, prompt, SamplingSpec(max_tokens=1), turn, cache_key=(body or {}).get("pck"))
    return turn, req.affinity_key


def test_a_sub_agent_lands_on_its_parents_worker() -> None:
    tracker = SessionTracker(SessionTable(BLOCK), ChainHasher(BLOCK, "fp"), IngressMetrics.create(CollectorRegistry()),
                             None)
    router = fleet()
    lead, lead_key = request(tracker, 1, "lead")
    tracker.finish(lead, [5, 6], [5], "stop", "prefill-x")
    lead_home = router.pick_prefill(3 * BLOCK, BLOCK, NOBODY_HOLDS_IT, lead_key)
    assert lead_home == home(scoped_session_id("t", "lead"), WORKERS)
    # sub-agents whose own ids would live elsewhere: each goes to the lead's worker, grandchildren too
    subs = [s for s in (f"sub-{i}" for i in range(40)) if home(scoped_session_id("t", s), WORKERS) != lead_home][:3]
    for n, sub in enumerate(subs, start=2):
        turn, key = request(tracker, n, sub, parent="lead")
        assert router.pick_prefill(3 * BLOCK, BLOCK, NOBODY_HOLDS_IT, key) == lead_home
        tracker.finish(turn, [5, 6], [5], "stop", lead_home)
    _, key = request(tracker, 9, "sub-of-sub", parent=subs[0])
    assert router.pick_prefill(3 * BLOCK, BLOCK, NOBODY_HOLDS_IT, key) == lead_home
    # prompt_cache_key still wins over the group, as over the session
    _, key = request(tracker, 10, subs[1], parent="lead", body={"pck": "cache-7"})
    assert key == "cache-7"
