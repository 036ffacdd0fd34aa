"""The service runner: HTTP side server, readiness, metrics, and a graceful drain (in-process and on SIGTERM)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from bus.helpers import FAST_BUS, connected, eventually, unique
from kvmesh.bus.publish import Publisher
from kvmesh.bus.request import request
from kvmesh.config import ServiceSettings, Settings
from kvmesh.net import free_port
from kvmesh.protocol import subjects
from kvmesh.protocol.messages import Role
from kvmesh.protocol.streams import JOBS, KV_EVENTS, ConsumerSpec
from kvmesh.service.runner import ServiceRunner
from nats.js.errors import KeyNotFoundError

from .sleepy_service import Status, StatusQuery, status_subject
from .sleepy_service import setup as sleepy_setup

SLEEPY = Path(__file__).with_name("sleepy_service.py")


def _settings(url: str, worker_id: str) -> Settings:
    return Settings(
        nats_url=url, bus=FAST_BUS,
        service=ServiceSettings(worker_id=worker_id, http_port=0, heartbeat_interval_s=0.3, heartbeat_ttl_s=2.0,
                                drain_timeout_s=10.0),
    )


async def _events(js, worker: str) -> list[bytes]:
    subject = subjects.kv_events(worker)
    info = await js.stream_info(KV_EVENTS.name, subjects_filter=subject)
    if not info.state.subjects:
        return []
    msg = await js.get_last_msg(KV_EVENTS.name, subject)
    return [msg.data]


async def test_runner_serves_http_and_drains_in_flight_work(nats_server):
    worker = unique("w")
    ready_flag = {"ok": True}

    async def setup(ctx):
        await sleepy_setup(ctx)
        ctx.ready_check = lambda: ready_flag["ok"]

    runner = ServiceRunner("sleepy", Role.TEST, setup, _settings(nats_server.url, worker))
    async with connected(nats_server.url) as nc:  # declares the streams, as `kvmesh up` does first
        run = asyncio.create_task(runner.run())
        await asyncio.wait_for(runner.wait_started(), 10)
        assert not run.done(), "runner failed to start"
        http = httpx.AsyncClient(base_url=runner.http_endpoint)
        js = nc.jetstream()
        assert (await http.get("/healthz")).status_code == 200

        async def ready() -> bool:
            return (await http.get("/readyz")).status_code == 200

        await eventually(ready, 10, "/readyz to turn 200")
        assert all((await http.get("/readyz")).json()["checks"].values())
        ready_flag["ok"] = False
        assert (await http.get("/readyz")).json()["checks"]["service"] is False
        ready_flag["ok"] = True
        hb = await (await js.key_value(subjects.WORKERS_BUCKET)).get(worker)  # ready means registered
        assert json.loads(hb.value)["http_endpoint"] == runner.http_endpoint

        await Publisher(js, FAST_BUS).publish(subjects.jobs_prefill(worker), b"1.0", msg_id=unique())

        await eventually(lambda: runner.ctx.consumers[0].in_flight == 1, 5, "the job's handler to run")
        assert await request(nc, status_subject(worker), StatusQuery(), Status, timeout_s=2) == Status(in_flight=1)
        runner.stop()

        async def unready() -> bool:
            return (await http.get("/readyz")).status_code == 503

        await eventually(unready, 2, "/readyz to turn 503 while draining")
        assert await asyncio.wait_for(run, 15) == 0
        assert await _events(js, worker) == [b"done:1.0"]  # the in-flight job finished before exit
        info = await js.consumer_info(JOBS.name, f"prefill-{worker}")
        assert info.num_ack_pending == 0 and info.num_pending == 0
        with pytest.raises(KeyNotFoundError):  # withdrawn on exit, not left to expire
            await (await js.key_value(subjects.WORKERS_BUCKET)).get(worker)
        await http.aclose()


async def test_metrics_endpoint_exposes_kvmesh_names(nats_server):
    worker = unique("w")
    runner = ServiceRunner("sleepy", Role.TEST, sleepy_setup, _settings(nats_server.url, worker))
    async with connected(nats_server.url) as nc:
        run = asyncio.create_task(runner.run())
        await asyncio.wait_for(runner.wait_started(), 10)
        http = httpx.AsyncClient(base_url=runner.http_endpoint)
        await Publisher(nc.jetstream(), FAST_BUS).publish(subjects.jobs_prefill(worker), b"0", msg_id=unique())
        label = f'kvmesh_messages_handled_total{{subject="{subjects.jobs_prefill(worker)}"}} 1.0'
        text = ""

        async def handled() -> bool:
            nonlocal text
            text = (await http.get("/metrics")).text
            return label in text

        await eventually(handled, 5, "the handled counter on /metrics")
        assert 'kvmesh_service_info{service="sleepy"} 1.0' in text
        assert "kvmesh_handler_seconds_bucket" in text and "kvmesh_heartbeat_age_seconds" in text
        await http.aclose()
        runner.stop()
        assert await asyncio.wait_for(run, 10) == 0


async def test_sigterm_drains_and_exits_zero(nats_server):
    worker = unique("w")
    port = free_port()
    env = {**os.environ, "KVMESH_NATS_URL": nats_server.url, "KVMESH_SERVICE__HTTP_PORT": str(port),
           "KVMESH_SERVICE__WORKER_ID": worker, "KVMESH_SERVICE__HEARTBEAT_INTERVAL_S": "0.3",
           "KVMESH_SERVICE__HEARTBEAT_TTL_S": "2", "KVMESH_LOG_LEVEL": "info"}
    async with connected(nats_server.url) as nc, httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
        js = nc.jetstream()
        proc = subprocess.Popen([sys.executable, str(SLEEPY)], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        try:
            await _sigterm_during_a_job(proc, http, js, worker)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    lines = [json.loads(line) for line in proc.stderr.read().splitlines() if line.startswith("{")]
    assert any(rec["event"] == "service ready" and rec["worker_id"] == worker and rec["service"] == "sleepy"
               for rec in lines)
    assert any(rec["event"] == "drained" for rec in lines)


async def _sigterm_during_a_job(proc: subprocess.Popen, http: httpx.AsyncClient, js, worker: str) -> None:
    async def ready() -> bool:
        assert proc.poll() is None, proc.stderr.read()
        try:
            return (await http.get("/readyz")).status_code == 200
        except httpx.TransportError:
            return False

    await eventually(ready, 60, "the service's /readyz")  # generous: imports on a loaded CI box
    await Publisher(js, FAST_BUS).publish(subjects.jobs_prefill(worker), b"1.5", msg_id=unique())

    gauge = f'kvmesh_messages_in_flight{{subject="{subjects.jobs_prefill(worker)}"}} 1.0'

    async def in_flight() -> bool:
        return gauge in (await http.get("/metrics")).text

    await eventually(in_flight, 5, "the job's handler to run")
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(proc.wait, 20) == 0
    assert time.monotonic() - t0 < 10
    assert await _events(js, worker) == [b"done:1.5"]  # the in-flight job finished before exit
    info = await js.consumer_info(JOBS.name, f"prefill-{worker}")
    assert info.num_ack_pending == 0 and info.num_pending == 0


async def test_a_failed_start_exits_one(nats_server):
    async def setup(ctx):
        spec = ConsumerSpec("NO_SUCH_STREAM", f"prefill-{ctx.worker_id}", subjects.jobs_prefill(ctx.worker_id))

        async def never(msg) -> None:
            raise AssertionError("no message can arrive")

        ctx.add_consumer(spec, never)

    runner = ServiceRunner("broken", Role.TEST, setup, _settings(nats_server.url, unique("w")))
    assert await asyncio.wait_for(runner.run(), 15) == 1
