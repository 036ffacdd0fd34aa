"""Which jobs this worker has run: the idempotency of prefill and decode handlers.

JetStream delivers at least once, so the same (request_id, attempt) can
arrive again: after a lost ack, or while the first delivery still runs.
`JobLedger.claim` says what to do with a delivery: run it, wait for the
run already in progress (and then ack), or ack at once because it already
finished here. A newer attempt of a request supersedes an older one still
running on this worker (the older one's output is no longer wanted), and an
attempt-scoped abort fences the attempts it names (`fence`, `stale`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from kvmesh.lru import BoundedLRU


class Claim(Enum):
    RUN = "run"  # first delivery of this attempt here: do the work
    WAIT = "wait"  # the same attempt is running here now: wait for it, then ack
    DONE = "done"  # finished here before, or a newer attempt exists: ack, do nothing


@dataclass(slots=True)
class _Run:
    attempt: int
    finished: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class JobLedger:
    remember: int = 4096
    _running: dict[str, _Run] = field(default_factory=dict)
    _finished: BoundedLRU[str, int] = field(init=False)  # request id -> highest attempt done
    _aborted: BoundedLRU[str, None] = field(init=False)  # the client went away: run nothing more

    def __post_init__(self) -> None:
        self._finished, self._aborted = BoundedLRU(self.remember), BoundedLRU(self.remember)

    def abort(self, request_id: str) -> None:
        """Remember that the request was aborted: its runs stop and later deliveries are acked unrun."""
        self._aborted.put(request_id, None)

    def aborted(self, request_id: str) -> bool:
        return request_id in self._aborted

    def fence(self, request_id: str, attempt: int) -> None:
        """Attempts up to `attempt` were replaced elsewhere (the ingress migrated the request): a run of one
        here must publish nothing more, and later deliveries of them are acked unrun. A newer attempt
        still runs here if it comes (the migration may come back to this worker)."""
        self._done(request_id, attempt)

    def stale(self, request_id: str, attempt: int) -> bool:
        """Whether (request_id, attempt) must publish nothing more: aborted, fenced, or a newer attempt
        running or done here."""
        run = self._running.get(request_id)
        return (request_id in self._aborted or self._finished.get(request_id, -1) >= attempt
                or (run is not None and run.attempt > attempt))

    def claim(self, request_id: str, attempt: int) -> Claim:
        if request_id in self._aborted:
            return Claim.DONE
        done = self._finished.get(request_id)
        if done is not None and done >= attempt:
            return Claim.DONE
        run = self._running.get(request_id)
        if run is not None:
            if run.attempt == attempt:
                return Claim.WAIT
            if run.attempt > attempt:
                return Claim.DONE
            run.finished.set()  # an older attempt is superseded: whoever waits on it need not wait longer
        self._running[request_id] = _Run(attempt)
        return Claim.RUN

    async def wait(self, request_id: str) -> None:
        run = self._running.get(request_id)
        if run is not None:
            await run.finished.wait()

    def release(self, request_id: str, attempt: int, finished: bool) -> None:
        """End this worker's run of (request_id, attempt); `finished` = it completed (redeliveries are acked)."""
        run = self._running.get(request_id)
        if run is not None and run.attempt == attempt:
            del self._running[request_id]
            run.finished.set()
        if finished:
            self._done(request_id, attempt)

    def _done(self, request_id: str, attempt: int) -> None:
        self._finished.put(request_id, max(attempt, self._finished.get(request_id, -1)))

    @property
    def running(self) -> int:
        return len(self._running)


def stop_here(ledger: JobLedger, running: dict[str, tuple[int, str]], abort_engine: Callable[[str], None],
              request_id: str, attempt: int | None) -> None:
    """An AbortRequest at this worker: every attempt (`attempt` None: the client went away) or `attempt` and
    older ones (a migration replaced them; a newer one may still come) publish nothing more, and the run
    here, if `running` (request id -> (attempt, engine id)) names one of them, is aborted in the engine
    (which frees its blocks at the next step)."""
    if attempt is None:
        ledger.abort(request_id)
    else:
        ledger.fence(request_id, attempt)
    run = running.get(request_id)
    if run is not None and (attempt is None or run[0] <= attempt):
        abort_engine(run[1])


async def run_once(ledger: JobLedger, request_id: str, attempt: int, work) -> bool:
    """Run `work()` unless this attempt already ran (or runs) here; False when it was skipped.

    A delivery that finds the same attempt running waits for that run; if the
    run failed (the message was nak'ed), this delivery runs it instead.
    """
    while (claim := ledger.claim(request_id, attempt)) is Claim.WAIT:
        await ledger.wait(request_id)
    if claim is Claim.DONE:
        return False
    finished = False
    try:
        await work()
        finished = True
    finally:
        ledger.release(request_id, attempt, finished)
    return True
