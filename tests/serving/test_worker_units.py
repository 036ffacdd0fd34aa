"""Units of the workers that need no processes: the job ledger, pins, the audit counters' parsing."""

from __future__ import annotations

import asyncio

from kvmesh.serving.audit_status import parse_counts
from kvmesh.serving.ledger import Claim, JobLedger, run_once


async def test_ledger_runs_each_attempt_once_and_acks_redeliveries():
    ledger = JobLedger(remember=2)
    runs: list[str] = []
    gate = asyncio.Event()

    async def work() -> None:
        runs.append("r")
        await gate.wait()

    first = asyncio.create_task(run_once(ledger, "a", 0, work))
    await asyncio.sleep(0)
    second = asyncio.create_task(run_once(ledger, "a", 0, work))  # the same attempt while it runs: waits
    await asyncio.sleep(0.01)
    assert not second.done()
    gate.set()
    assert await first is True and await second is False and runs == ["r"]
    assert ledger.claim("a", 0) is Claim.DONE  # after it finished: acked at once
    assert await run_once(ledger, "a", 1, work) is True  # a newer attempt runs
    assert len(runs) == 2


async def test_ledger_failed_run_lets_the_redelivery_run():
    ledger = JobLedger()

    async def boom() -> None:
        raise RuntimeError("publish failed")

    try:
        await run_once(ledger, "b", 0, boom)
    except RuntimeError:
        pass
    assert ledger.claim("b", 0) is Claim.RUN


def test_ledger_abort_and_supersede():
    ledger = JobLedger()
    assert ledger.claim("c", 0) is Claim.RUN
    assert ledger.claim("c", 1) is Claim.RUN  # supersedes attempt 0 here
    assert ledger.claim("c", 0) is Claim.DONE  # the older attempt is not wanted any more
    ledger.abort("d")
    assert ledger.claim("d", 0) is Claim.DONE and ledger.aborted("d")


def test_parse_audit_counts():
    text = "# HELP x\nkvmesh_cache_audit_total 7.0\nkvmesh_cache_audit_created 1.7e9\nkvmesh_cache_audit_mismatch_total 1.0\n"
    assert parse_counts(text) == (7, 1)
    assert parse_counts("") == (0, 0)


def test_ledger_fence_stops_replaced_attempts_only():
    ledger = JobLedger()
    assert ledger.claim("f", 0) is Claim.RUN
    ledger.fence("f", 0)  # a migration replaced attempt 0 while it runs here
    assert ledger.stale("f", 0) and not ledger.aborted("f")
    assert ledger.claim("f", 0) is Claim.DONE  # a redelivery of the replaced attempt is acked unrun
    assert not ledger.stale("f", 1)
    assert ledger.claim("f", 1) is Claim.RUN  # the migration may come back here: the newer attempt runs
    ledger.release("f", 0, finished=True)  # the replaced run ends later; attempt 1 is still wanted
    assert not ledger.stale("f", 1) and ledger.claim("f", 1) is Claim.WAIT


def test_ledger_a_newer_attempt_running_here_makes_the_older_stale():
    """An older attempt still fetching its blocks when a newer one starts here must not take the engine
    back from it (it would abort the newer run, then be fenced itself when that run ends: no final event)."""
    ledger = JobLedger()
    assert ledger.claim("g", 0) is Claim.RUN
    assert not ledger.stale("g", 0)
    assert ledger.claim("g", 1) is Claim.RUN  # the retry's handoff, while attempt 0 still resolves
    assert ledger.stale("g", 0) and not ledger.stale("g", 1)
    ledger.release("g", 0, finished=False)  # attempt 0 gives up: the newer run stays registered
    assert ledger.stale("g", 0) and not ledger.stale("g", 1) and ledger.claim("g", 1) is Claim.WAIT
    ledger.release("g", 1, finished=True)
    assert ledger.stale("g", 0) and ledger.stale("g", 1)
