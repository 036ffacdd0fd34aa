"""Drives a session-aware policy from a trace, in the order the live service sees turn events.

Per request: its session (the trace's ``session_id``, else inferred from the
chain) starts a turn at arrival (``turn_started``: the predictor learns the
gap); the cache serves it; the turn ends with what the trace says the
answer did (``tool_calls``: names -> TOOL_CALLS, ``[]`` -> ANSWER, no
field -> ANSWER, the server knowing nothing more); the blocks whose next use
moved are re-keyed; the policy's pin, if any, is granted within the pool's
``PinBudget`` to the leading blocks of the request's chain that L1 holds.

When the turn ends: a server publishes the outcome once the answer is
decoded, so the end is stamped ``output_length / decode_tokens_per_s``
after arrival (queueing is not modeled; 0: at arrival) and the predictor
learns the gap from there to the next turn, i.e. the tool's run, as it does
live. The event is applied right after the request is served rather than
replayed at its stamp: in a live server the blocks of a decoding request
cannot be evicted, so their rank during the decode does not matter; in
the replay they are not locked, and ranking them "in use" for the decode
would protect them beyond what a live pool does (measured: it costs a
third of the session policy's hits at 2 % on the agent trace).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.cache_policy.pin_budget import PinBudget
from kvmesh.cache_policy.session import SessionAware
from kvmesh.sessions.events import TurnOutcome
from kvmesh.sessions.inference import SessionInference
from kvmesh.sim.tiers import TieredCache
from kvmesh.sim.trace import TraceRequest


@dataclass(slots=True)
class SessionDriver:
    policy: SessionAware
    cache: TieredCache
    pin_fraction: float | None = None  # None: the policy's own
    inference: SessionInference = field(default_factory=SessionInference)
    budget: PinBudget = field(init=False)
    errors: list[float] = field(default_factory=list)  # signed return-time prediction errors (s)
    pinned_max: int = 0  # the most blocks pinned at once (after a grant)
    decode_tokens_per_s: float = 0.0  # a turn ends its decode time after arrival (0: at arrival)
    groups: bool = True  # link a sub-agent to the parent the trace names (off: to measure what that gives)

    def __post_init__(self) -> None:
        fraction = self.policy.pin_fraction if self.pin_fraction is None else self.pin_fraction
        self.budget = PinBudget.for_pool(self.cache.l1.capacity, fraction)

    def session_of(self, request: TraceRequest) -> str:
        full = request.blocks[: request.input_length // request.block_size]
        if request.session_id is not None:
            if full:
                self.inference.record(full[-1], request.session_id)
            return request.session_id
        return self.inference.assign(full)[0]

    def started(self, request: TraceRequest) -> str:
        """Before the cache serves ``request``: its turn starts. Returns its session."""
        session = self.session_of(request)
        named = request.session_id is not None  # the trace's id is the client's: otherwise it is inferred
        if named and request.parent_session_id is not None and self.groups:
            self.policy.book.link(session, request.parent_session_id)
        error = self.policy.book.turn_started(session, request.blocks, request.time_s, explicit=named)
        if error is not None:
            self.errors.append(error)
        self.cache.rekey(self.policy.book.take_changed(), request.time_s)
        return session

    def ended(self, request: TraceRequest, session: str) -> None:
        """After: its turn ends with what the answer did, once decoded; re-key, then pin within the budget."""
        clock = request.time_s
        rate = self.decode_tokens_per_s
        now = clock + (request.output_length / rate if rate > 0 else 0.0)  # the end's stamp
        tools = request.tool_calls or ()
        outcome = TurnOutcome.TOOL_CALLS if tools else TurnOutcome.ANSWER
        self.policy.book.turn_ended(session, now, outcome, tools, now=clock)
        self.cache.rekey(self.policy.book.take_changed(), now)
        until = self.policy.pin_after_turn(session, now)
        if until is None:
            return
        l1 = self.cache.l1
        held = list(request.blocks[: l1.match_prefix(request.blocks)])
        for h in self.budget.grant(held, until, clock):
            l1.pin(h, until)
        self.pinned_max = max(self.pinned_max, self.budget.used(clock))
