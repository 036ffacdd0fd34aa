"""The named chaos scenarios and the runner that drives load through fault, heal and recovery.

A scenario is three steps on a running `ChaosStack`: `inject` (at the
fault's start), `heal` (after the fault window: a killed worker is started
again, a proxy passes traffic again), and `cleanup` (bring the stack back to
full strength, so the next scenario starts healthy). The load runs a
baseline first (a quarter of the fault window, at most `BASELINE_MAX_S`),
and after the heal until latency is back (chaos/invariants.py,
`recovery_s`) or its bound has passed. Phases end on conditions, each with a
deadline, never on a bare sleep.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmesh.chaos import index_truth, invariants, l3_corrupt, overload, zombie
from kvmesh.chaos.load import Load, Outcome
from kvmesh.chaos.proxy import Fault, FaultProxy
from kvmesh.chaos.report import counts, plot
from kvmesh.chaos.stack import API_KEY, BUCKET, EVICTION, INDEX, WORKERS, ChaosStack

Step = Callable[[ChaosStack], None]


def _nothing(stack: ChaosStack) -> None:
    """A step with nothing to do."""


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    doc: str
    inject: Step
    heal: Step = _nothing
    cleanup: Step = _nothing
    timed_fault: bool = True  # False: the probe is the fault (it runs its own steps); heal follows at once
    probe: Callable[[ChaosStack, dict[str, str]], dict[str, bool]] | None = None  # own checks in the fault window


def _signal(service_id: str, sig: int) -> Step:
    return lambda stack: stack.signal(service_id, sig)


def _kill(service_id: str) -> Step:
    return _signal(service_id, signal.SIGKILL)


def _restart(service_id: str) -> Step:
    return lambda stack: stack.restart(service_id)


def _proxies(stack: ChaosStack, which: str) -> list[FaultProxy]:
    return stack.nats_proxies if which == "nats" else [stack.s3_proxy]


def _proxy(which: str, fault: Fault) -> Step:
    def step(stack: ChaosStack) -> None:
        for proxy in _proxies(stack, which):
            proxy.set(fault)
    return step


def _proxy_heal(which: str) -> Step:
    return _proxy(which, Fault())


def _lossy_events() -> tuple[Step, Step]:
    """The index down while KV events pile up; at the heal half of them are deleted, the rest doubled."""
    mark: dict[str, int] = {}

    def inject(stack: ChaosStack) -> None:
        stack.signal(INDEX, signal.SIGKILL)
        mark["seq"] = index_truth.last_event_seq(stack.nats_urls)

    def heal(stack: ChaosStack) -> None:
        index_truth.drop_and_duplicate(stack.nats_urls, mark["seq"])
        stack.restart(INDEX)

    return inject, heal


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("decode-kill", "SIGKILL a decode worker mid-stream; its requests migrate to the other one; it is "
             "started again after the fault window", _kill("decode-0"), _restart("decode-0")),
    Scenario("prefill-kill", "SIGKILL a prefill worker holding jobs; the ingress retries them elsewhere; it is "
             "started again after the fault window", _kill("prefill-0"), _restart("prefill-0")),
    Scenario("decode-pause", "SIGSTOP a decode worker for the fault window (its heartbeat lapses, its streams "
             "migrate), then SIGCONT: the zombie must not disturb the streams it lost",
             _signal("decode-0", signal.SIGSTOP), _signal("decode-0", signal.SIGCONT)),
    Scenario("decode-pause-sampled", "a seeded sampled stream: SIGSTOP its decode worker mid-answer, the ingress "
             "migrates it, SIGCONT while the new attempt streams: the zombie stops its replaced attempt and the "
             "client gets exactly the reference continuation", _nothing, timed_fault=False, probe=zombie.probe),
    Scenario("worker-latency", "40 ms +- 20 ms added between every worker and NATS",
             _proxy("nats", Fault(latency_ms=40, jitter_ms=20)), _proxy_heal("nats")),
    Scenario("s3-slow", "300 ms +- 100 ms and a 2 MB/s cap between the workers and S3",
             _proxy("s3", Fault(latency_ms=300, jitter_ms=100, bandwidth_bps=2e6)), _proxy_heal("s3")),
    Scenario("s3-outage", "every worker connection to S3 reset; L3 must degrade to a miss, not an error",
             _proxy("s3", Fault(reset=True)), _proxy_heal("s3")),
    Scenario("index-restart", "SIGKILL the cache index; routing degrades to load-only, then it restarts from "
             "its snapshot and replays the events it missed", _kill(INDEX), _restart(INDEX)),
    Scenario("eviction-kill", "SIGKILL the eviction service; serving goes on (workers evict locally), then it "
             "restarts", _kill(EVICTION), _restart(EVICTION)),
    Scenario("kv-events-drop-dup", "the cache index down while KV events pile up; every other batch is then "
             "deleted from the stream and the rest published twice; the restarted index repairs the gaps by "
             "state dumps", *_lossy_events()),
    Scenario("ingress-restart", "SIGKILL the ingress; clients get a clean connection error, then it comes back",
             _kill("ingress-0"), _restart("ingress-0"), timed_fault=True),
    Scenario("nats-leader-kill", "SIGKILL the NATS node leading the JOBS stream (3-node cluster, R3 streams), "
             "restart it after the fault window", lambda stack: stack.kill_nats_leader(),
             lambda stack: stack.restart_dead_nats()),
    Scenario("l3-corrupt", "flip a byte in every stored L3 chunk; with every worker killed, a prefill worker restarted empty must read "
             "them, counts checksum misses, still answers the reference, and the damaged objects go",
             _nothing, cleanup=l3_corrupt.restart_rest, timed_fault=False, probe=l3_corrupt.probe),
    Scenario("overload", f"a burst of {overload.BURST} requests over an in-flight limit of {overload.OVERLOAD_LIMIT}: "
             "429/503 + Retry-After at once, admitted ones correct", _nothing, timed_fault=False,
             probe=overload.probe),
)}


BASELINE_MAX_S = 20.0
ERRORED_LISTED = 20  # errored requests named in a report (the count is in `requests`)


def _wait(cond: Callable[[], bool], timeout_s: float, poll_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(poll_s)
    return cond()


def _done_after(load: Load, t: float) -> int:
    return sum(1 for o in list(load.outcomes) if o.started >= t)


def run(stack: ChaosStack, scenario: Scenario, refs: dict[str, str], duration_s: float = 6.0,
        plot_dir: Path | None = None, sessions: int = 3) -> dict[str, Any]:
    """Baseline load, fault for duration_s (or an instant), heal, recovery; the scenario's report dict."""
    load = Load(stack.base_url, API_KEY, stack.model_dir.name, sessions=sessions).start()
    t0 = time.monotonic()
    baseline_s = min(BASELINE_MAX_S, duration_s / 4)
    try:
        _wait(lambda: len(load.outcomes) >= 2 * sessions and time.monotonic() - t0 >= baseline_s, 60 + baseline_s)
        fault_at = time.monotonic()
        base_p99 = invariants.p99_ms([o for o in list(load.outcomes) if o.ended <= fault_at]) or 0.0
        scenario.inject(stack)
        probed = scenario.probe(stack, refs) if scenario.probe is not None else {}
        if scenario.timed_fault:
            _wait(lambda: time.monotonic() - fault_at >= duration_s, duration_s)
        scenario.heal(stack)
        healed_at = time.monotonic()
        _wait(lambda: invariants.recovery_s(list(load.outcomes), healed_at, base_p99) is not None,
              invariants.RECOVERY_BOUND_S + invariants.RECOVERY_WINDOW_S + load.request_timeout_s, poll_s=0.5)
    except BaseException:
        load.finish()
        scenario.cleanup(stack)  # a broken scenario must not leave the next one a broken stack
        raise
    outcomes = load.finish()
    scenario.cleanup(stack)
    during = [o for o in outcomes if o.started < healed_at and o.ended > fault_at]
    recovery = invariants.recovery_s(outcomes, healed_at, base_p99)
    report: dict[str, Any] = {
        "scenario": scenario.name,
        "requests": counts(outcomes),
        "latency_p99_ms": {"baseline": base_p99, "fault": invariants.p99_ms(during),
                           "after": invariants.p99_ms([o for o in outcomes if o.started >= healed_at])},
        "fault_s": round(healed_at - fault_at, 3),
        "recovery_s": None if recovery is None else round(recovery, 3),
        "recovery_bound_s": invariants.RECOVERY_BOUND_S,
        "recovery_window_s": invariants.RECOVERY_WINDOW_S,
        "invariants": {
            "outputs_identical": invariants.ok_outputs_identical(outcomes, refs),
            "errors_clean": invariants.errors_clean(outcomes, load.request_timeout_s),
            "nothing_pending": invariants.nothing_pending(stack.nats_urls),
            "index_converged": index_truth.index_converged(stack.nats_urls, WORKERS),
            "l3_intact": invariants.l3_intact(stack.s3.client(), BUCKET),
            "recovered": recovery is not None and recovery <= invariants.RECOVERY_BOUND_S,
            **probed,
        },
        "errors": sorted({o.error for o in outcomes if not o.ok})[:5],
        # which requests failed and why, timed from the fault (a scenario may have to fail some: ingress down)
        "errored_requests": [{"started_s": round(o.started - fault_at, 3), "ended_s": round(o.ended - fault_at, 3),
                              "prompt": o.prompt, "status": o.status, "error": o.error}
                             for o in outcomes if not o.ok][:ERRORED_LISTED],
    }
    if plot_dir is not None:
        report["plot"] = str(plot(plot_dir / f"{scenario.name}.png", scenario.name, outcomes, t0,
                                  (fault_at, healed_at)))
    return report


def outcomes_ok(report: dict[str, Any]) -> bool:
    return all(report["invariants"].values())


__all__ = ["SCENARIOS", "Scenario", "run", "outcomes_ok", "Outcome"]
