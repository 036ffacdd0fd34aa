"""Every chaos scenario, short form, against one shared real stack (3-node NATS, S3, 2+2 workers, ingress,
cache index, eviction).

Scenarios run in a fixed order on the same stack; each heals and restores
full strength in its cleanup, so the next starts healthy. A scenario passes
when every invariant holds: outputs identical to the fault-free reference,
errors clean and retriable, nothing left pending in JetStream, the cache
index agreeing with every worker's own state, no damaged L3 object left, latency
recovered. The last test checks that stopping the stack leaks nothing.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvmesh.chaos.load import Load
from kvmesh.chaos.scenarios import SCENARIOS, run
from kvmesh.chaos.stack import API_KEY, ChaosStack

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[ChaosStack]:
    s = ChaosStack(tmp_path_factory.mktemp("chaos"), tiny_model_dir, nats_nodes=3)
    try:
        yield s.start()
    finally:
        s.stop()


@pytest.fixture(scope="module")
def refs(stack: ChaosStack) -> dict[str, str]:
    return Load(stack.base_url, API_KEY, stack.model_dir.name).references()


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario(stack: ChaosStack, refs: dict[str, str], name: str, tmp_path: Path) -> None:
    report = run(stack, SCENARIOS[name], refs, duration_s=3.0, plot_dir=tmp_path)
    print(json.dumps(report))
    assert report["requests"]["ok"] > 0
    assert report["invariants"] == {k: True for k in report["invariants"]}, report
    assert Path(report["plot"]).stat().st_size > 0


def test_stop_leaks_nothing(stack: ChaosStack) -> None:
    """Runs last: stopping the shared stack leaves no process alive and no port bound (stop is idempotent)."""
    assert stack.stop() == []
