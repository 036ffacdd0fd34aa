"""Per-worker consumers: deleted when their worker drains, expired by the server after an abrupt end.

Real nats-server; the workers run the real consumer setup (`command_consumer`,
`own_job_consumers`, the shared queues) in the real service shell.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from kvmesh.bus.consumer import ConsumerLoop
from kvmesh.bus.publish import Publisher
from kvmesh.metrics import ServiceMetrics
from kvmesh.protocol import subjects
from kvmesh.protocol.messages import Role
from kvmesh.protocol.streams import (
    ALL_CONSUMERS,
    COMMANDS,
    HANDOFF,
    JOBS,
    declare_consumer,
    worker_consumer,
)
from kvmesh.serving.services import own_job_consumers
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from .churn_workers import runner
from .helpers import FAST_BUS, connected, eventually, unique

REPO = Path(__file__).resolve().parents[2]
SHORT = FAST_BUS.model_copy(update={"worker_consumer_inactive_s": 1.5})
LONG = FAST_BUS.model_copy(update={"worker_consumer_inactive_s": 300.0})
WORKER_STREAMS = (JOBS.name, HANDOFF.name, COMMANDS.name)
SHARED_NAMES = {c.durable for c in ALL_CONSUMERS if c.stream in WORKER_STREAMS}  # the `any` queues


async def _running_loop(js: JetStreamContext, spec, handler, bus) -> tuple[ConsumerLoop, asyncio.Task]:
    """A ConsumerLoop on `spec` running in a task, once its consumer is bound."""
    metrics = ServiceMetrics.create("test")
    loop = ConsumerLoop(js, spec, handler, Publisher(js, bus, metrics), metrics, bus, 5.0)
    task = asyncio.create_task(loop.run())
    await loop.wait_ready()
    return loop, task


async def _names(js: JetStreamContext) -> set[str]:
    return {c.name for stream in WORKER_STREAMS for c in await js.consumers_info(stream)}


async def _worker_consumers(js: JetStreamContext) -> set[str]:
    return await _names(js) - SHARED_NAMES


def _jsz_consumers(server) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.monitor_port}/jsz", timeout=5) as reply:
        return json.load(reply)["consumers"]


def _own_names(role: Role, wid: str) -> set[str]:
    return {f"cmd-{wid}", *(s.durable for s in own_job_consumers(role, wid))}


def _wait_ready(child: subprocess.Popen) -> None:
    """Until the child prints `ready` (its log lines come first); its early exit fails the test."""
    for line in child.stdout:
        if line.strip() == "ready":
            return
    raise AssertionError(f"churn_workers.py exited with {child.wait()} before it was ready")


async def _stop(runners, tasks) -> None:
    for r in runners:
        r.stop()
    assert await asyncio.wait_for(asyncio.gather(*tasks), 60) == [0] * len(tasks)


async def test_drain_deletes_own_consumers_abrupt_end_leaves_them(fresh_nats_server) -> None:
    """The threshold here is long: what disappears was deleted by the drain, not expired."""
    url = fresh_nats_server.url
    async with connected(url) as nc:
        js = nc.jetstream()
        old = own_job_consumers(Role.DECODE, "d-clean")[0]
        await declare_consumer(js, old)  # as an earlier version declared it: no threshold
        clean, crashed = runner(url, Role.DECODE, "d-clean", LONG), runner(url, Role.PREFILL, "p-crash", LONG)
        tasks = [asyncio.create_task(r.run()) for r in (clean, crashed)]
        await asyncio.wait_for(asyncio.gather(clean.wait_started(), crashed.wait_started()), 30)
        names = await _worker_consumers(js)
        assert names == _own_names(Role.DECODE, "d-clean") | _own_names(Role.PREFILL, "p-crash")
        assert (await js.consumer_info(HANDOFF.name, old.durable)).config.inactive_threshold == 300.0  # updated

        await _stop([clean], tasks[:1])
        assert await _worker_consumers(js) == _own_names(Role.PREFILL, "p-crash")
        tasks[1].cancel()  # cancelled loops end without their drain: nothing is deleted
        await asyncio.gather(tasks[1], return_exceptions=True)
        assert await _worker_consumers(js) == _own_names(Role.PREFILL, "p-crash")
        assert SHARED_NAMES <= await _names(js)


async def test_busy_worker_keeps_its_consumer_past_the_threshold(fresh_nats_server) -> None:
    """A handler holding a message (no fetches meanwhile) is activity; an idle twin proves the threshold passed."""
    url = fresh_nats_server.url
    bus = FAST_BUS.model_copy(update={"worker_consumer_inactive_s": 1.0, "fetch_batch": 1})
    busy_spec, idle_spec = (worker_consumer(JOBS, "prefill", w, subjects.jobs_prefill(w)) for w in ("busy", "idle"))
    taken, release = asyncio.Event(), asyncio.Event()

    async def hold(msg: Msg) -> None:
        taken.set()
        await release.wait()

    async with connected(url) as nc:
        js = nc.jetstream()
        loop, task = await _running_loop(js, busy_spec, hold, bus)
        await js.publish(subjects.jobs_prefill("busy"), b"{}", headers={subjects.HDR_MSG_ID: unique()})
        await asyncio.wait_for(taken.wait(), 10)
        await declare_consumer(js, idle_spec, inactive_threshold_s=1.0)  # declared once, never fetched from

        async def idle_gone() -> bool:
            try:
                await js.consumer_info(JOBS.name, idle_spec.durable)
                return False
            except NotFoundError:
                return True
        await eventually(idle_gone, 30, "the idle consumer expires")
        assert (await js.consumer_info(JOBS.name, busy_spec.durable)).num_ack_pending == 1
        release.set()
        loop.stop()
        await asyncio.wait_for(task, 10)
        assert busy_spec.durable not in await _names(js)


async def test_consumer_deleted_under_a_running_loop_is_declared_again(fresh_nats_server) -> None:
    url = fresh_nats_server.url
    spec = worker_consumer(JOBS, "decode", "d-again", subjects.jobs_decode("d-again"))
    got: list[bytes] = []

    async def handle(msg: Msg) -> None:
        got.append(msg.data)

    async with connected(url) as nc:
        js = nc.jetstream()
        loop, task = await _running_loop(js, spec, handle, LONG)
        await js.delete_consumer(JOBS.name, spec.durable)  # expired during a partition, or by an operator
        await js.publish(subjects.jobs_decode("d-again"), b"after", headers={subjects.HDR_MSG_ID: unique()})
        await eventually(lambda: got == [b"after"], 30, "the job published after the deletion is handled")
        loop.stop()
        await asyncio.wait_for(task, 10)


async def test_a_long_idle_pull_delivers_at_once_and_does_not_hold_up_a_stop(fresh_nats_server) -> None:
    """A per-worker consumer waits `worker_fetch_timeout_s` per pull (2 minutes here): a job still arrives while
    it waits, a stop cuts the pull short, and a job sent after the stop waits in the stream for the id's next
    consumer."""
    bus = LONG.model_copy(update={"worker_fetch_timeout_s": 120.0})
    wid = unique("long")
    spec, subject = worker_consumer(JOBS, "prefill", wid, subjects.jobs_prefill(wid)), subjects.jobs_prefill(wid)
    got: list[bytes] = []

    async def handle(msg: Msg) -> None:
        got.append(msg.data)

    async with connected(fresh_nats_server.url) as nc:
        js = nc.jetstream()
        loop, task = await _running_loop(js, spec, handle, bus)
        await js.publish(subject, b"first", headers={subjects.HDR_MSG_ID: unique()})
        await eventually(lambda: got == [b"first"], 30, "the job is handled while the pull waits")
        loop.stop()
        await asyncio.wait_for(task, 30)  # not the rest of the 120 s pull
        assert spec.durable not in await _names(js)
        await js.publish(subject, b"later", headers={subjects.HDR_MSG_ID: unique()})
        loop, task = await _running_loop(js, spec, handle, bus)
        await eventually(lambda: got == [b"first", b"later"], 30, "the next consumer of the id takes it")
        loop.stop()
        await asyncio.wait_for(task, 30)


async def test_churn_of_200_worker_ids_leaves_no_consumers(fresh_nats_server) -> None:
    """150 worker ids drain cleanly (in waves), 50 die with SIGKILL (two processes of 25); once the
    threshold has passed, only the shared queues remain."""
    url = fresh_nats_server.url
    ids = [(Role.PREFILL if i % 2 else Role.DECODE, f"w{i:03d}") for i in range(200)]
    clean, killed = ids[:150], ids[150:]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    async with connected(url) as nc:
        js = nc.jetstream()
        shared_before = await _names(js)
        children = [subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("churn_workers.py")), url, "1.5",
             *(f"{role.value}:{wid}" for role, wid in killed[k:k + 25])],
            env=env, stdout=subprocess.PIPE, text=True) for k in (0, 25)]
        try:
            for wave in range(0, len(clean), 25):
                runners = [runner(url, role, wid, SHORT) for role, wid in clean[wave:wave + 25]]
                tasks = [asyncio.create_task(r.run()) for r in runners]
                await asyncio.wait_for(asyncio.gather(*(r.wait_started() for r in runners)), 120)
                assert not any(t.done() for t in tasks), "a worker failed to start"
                await _stop(runners, tasks)
            for child in children:
                await asyncio.wait_for(asyncio.to_thread(_wait_ready, child), 180)
            expected = set().union(*(_own_names(role, wid) for role, wid in killed))
            assert expected <= await _worker_consumers(js)  # the killed ones' consumers are all there
        finally:
            for child in children:
                child.send_signal(signal.SIGKILL)
                child.wait()

        async def none_left() -> bool:  # the server's own count: no other consumer of any kind is left
            return not await _worker_consumers(js) and _jsz_consumers(fresh_nats_server) == len(ALL_CONSUMERS)
        await eventually(none_left, 60, "every per-worker consumer expires or was deleted")
        assert await _names(js) == shared_before == SHARED_NAMES  # the shared queues stay
