"""`kvmesh bench heartbeat-watch` end to end on a small fleet: every layer receives the writes and is costed."""

from __future__ import annotations

import json

from kvmesh.cli.main import app
from typer.testing import CliRunner


def test_bench_heartbeat_watch_small_runs_and_reports():
    result = CliRunner().invoke(app, ["bench", "heartbeat-watch", "--json", "--workers", "20", "--period-s", "0.5",
                                      "--window-s", "1"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["config"]["heartbeats_per_s"] == 40.0 and out["config"]["writes"] > 0
    assert set(out["layers"]) == {"core_subscription", "ordered_consumer", "kv_watcher", "watch_workers"}
    for layer in out["layers"].values():  # ~40 in the second measured; a layer that saw none would read 0
        assert layer["messages"] >= 10 and layer["cpu_us_per_message"] > 0
    assert out["ratio_to_core_subscription"]["core_subscription"] == 1.0 and out["parse_only_us"] > 0
