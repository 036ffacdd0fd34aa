"""`kvmesh up --nats-cluster 3`: three routed nats-servers, R3 streams, services on all nodes, nothing left by down."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import nats
import nats.js.errors
import pytest
from kvmesh.stack.errors import ExitCode
from kvmesh.stack.servers import NatsNodePorts, nats_cluster
from kvmesh.stack.state import StackState
from stack_harness import StackDir, admin_nats, assert_all_gone, assert_one_line_failure

RUNNER_PACKAGE = "kvmesh_stacktest_runner"  # a service on the real runner: it must reach NATS to get ready
NODES = ["nats-0", "nats-1", "nats-2"]
TEST_STREAM = "CLUSTERTEST"


def node_ports(state: StackState) -> dict[str, list[int]]:
    return {r.name: r.ports for r in state.processes if r.name in NODES}


async def check_cluster(state: StackState) -> None:
    """JOBS is R3 with a leader; a message written to an R3 stream is kept."""
    nc = await nats.connect(**admin_nats(state))
    js = nc.jetstream()
    info = await js.stream_info("JOBS")
    assert info.config.num_replicas == 3 and info.cluster is not None and info.cluster.leader
    assert {info.cluster.leader, *(p.name for p in info.cluster.replicas)} == {f"kvmesh-{n}" for n in NODES}
    await js.add_stream(name=TEST_STREAM, subjects=["clustertest.>"], num_replicas=3)
    await js.publish("clustertest.one", b"kept by the cluster")
    await nc.close()


async def kept_messages(state: StackState, timeout_s: float = 30.0) -> list[bytes]:
    """The test stream's messages, once the restarted cluster has elected the stream's leader again."""
    nc = await nats.connect(**admin_nats(state))
    js = nc.jetstream()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                info = await js.stream_info(TEST_STREAM)
                return [(await js.get_msg(TEST_STREAM, seq)).data for seq in range(1, info.state.messages + 1)]
            except (nats.errors.TimeoutError, nats.js.errors.ServiceUnavailableError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
    finally:
        await nc.close()


async def heartbeats(state: StackState, want: str, timeout_s: float = 30.0) -> set[str]:
    """The `workers` bucket's keys once `want` is among them (or the deadline passed). Watched, not read
    directly: an R3 bucket's direct reads may come from a replica that has not applied the newest heartbeat."""
    nc = await nats.connect(**admin_nats(state))
    watcher = await (await nc.jetstream().key_value("workers")).watchall()
    keys: set[str] = set()
    deadline = time.monotonic() + timeout_s
    try:
        while want not in keys:
            entry = await watcher.updates(timeout=max(deadline - time.monotonic(), 0.01))
            if entry is not None:
                (keys.add if entry.operation is None else keys.discard)(entry.key)
    except nats.errors.TimeoutError:
        pass
    finally:
        await watcher.stop()
        await nc.close()
    return keys


def told_nats_url(pid: int) -> str:
    env = dict(v.split("=", 1) for v in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in v)
    return env["KVMESH_NATS_URL"]


def test_cluster_up_status_restart_down(stack: StackDir, model_stub: Path) -> None:
    stack.env["KVMESH_STACK__SERVICES_PACKAGE"] = RUNNER_PACKAGE
    args = stack.up_args("--detach", "--nats-cluster", "3")  # node 0 takes --nats-port and --nats-monitor-port
    out = stack.cli(*args, "--fresh", "--replicas", "pinger=1", "--model", str(model_stub))
    assert out.returncode == 0, out.stderr
    state = stack.state()
    assert [r.name for r in state.processes] == [*NODES, "s3", "pinger-0"]
    ports = node_ports(state)
    assert all(len(p) == 3 for p in ports.values()) and len({p for ps in ports.values() for p in ps}) == 9
    assert state.nats_url == ",".join(e.url for e in state.endpoints if e.name in NODES)

    code, st = stack.status_json()
    assert code == 0 and st["ready"], st
    assert [p["name"] for p in st["processes"] if p["name"].startswith("nats")] == NODES
    assert all(p["alive"] for p in st["processes"])
    assert {e["name"] for e in st["endpoints"] if e["ready"]} >= {*NODES, *(f"{n}-monitor" for n in NODES)}

    pinger = next(r for r in state.processes if r.name == "pinger-0")
    assert told_nats_url(pinger.pid) == state.nats_url  # every node, comma separated
    assert "pinger-0" in asyncio.run(heartbeats(state, "pinger-0"))
    asyncio.run(check_cluster(state))

    assert stack.cli("down").returncode == 0
    assert_all_gone(stack, state)

    # restart on the same state dir: same node ports, the cluster's data kept
    again = stack.cli(*args, "--replicas", "pinger=0")
    assert again.returncode == 0, again.stderr
    state2 = stack.state()
    assert node_ports(state2) == ports
    assert asyncio.run(kept_messages(state2)) == [b"kept by the cluster"]
    assert stack.cli("down").returncode == 0
    assert_all_gone(stack, state2)
    assert json.loads((stack.state_dir / "nats-1" / "ports.json").read_text())["client"] == ports["nats-1"][0]


@pytest.mark.parametrize("n", ["2", "4", "0"])
def test_cluster_size_without_a_quorum_is_a_usage_error(stack: StackDir, n: str) -> None:
    out = stack.up("--nats-cluster", n)
    assert_one_line_failure(out, ExitCode.USAGE, f"--nats-cluster {n}", "odd number")
    assert stack.state() is None and not stack.seen  # nothing started


def test_cluster_size_from_settings_is_checked_too(stack: StackDir) -> None:
    out = stack.up(KVMESH_NATS__CLUSTER_NODES="2")
    assert_one_line_failure(out, ExitCode.USAGE, "--nats-cluster 2", "nats.cluster_nodes")
    assert stack.state() is None and not stack.seen


def test_cluster_with_external_nats_is_a_usage_error(stack: StackDir) -> None:
    out = stack.up("--nats-cluster", "3", KVMESH_NATS_URL="nats://127.0.0.1:4222")
    assert_one_line_failure(out, ExitCode.USAGE, "--nats-cluster 3", "KVMESH_NATS_URL")
    assert stack.state() is None and not stack.seen


def test_nats_cluster_routes_each_node_to_the_others(tmp_path: Path) -> None:
    nodes = nats_cluster(tmp_path, 3, "c", [NatsNodePorts(client=4999)])
    assert [n.server_name for n in nodes] == ["c-0", "c-1", "c-2"] and nodes[0].port == 4999
    assert [n.data_dir for n in nodes] == [tmp_path / f"nats-{i}" for i in range(3)]
    ports = [p for n in nodes for p in (n.port, n.monitor_port, n.cluster["port"])]
    assert len(set(ports)) == 9 and 0 not in ports  # picked up front, distinct
    for i, node in enumerate(nodes):
        others = {f"nats-route://127.0.0.1:{m.cluster['port']}" for j, m in enumerate(nodes) if j != i}
        assert set(node.cluster["routes"]) == others and node.cluster["name"] == "c"
    for bad in (1, 2, 4):
        with pytest.raises(ValueError):
            nats_cluster(tmp_path, bad, "c")
