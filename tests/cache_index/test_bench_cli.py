"""`kvmesh bench index` runs end to end on a small workload and reports every figure."""

from __future__ import annotations

import json

from kvmesh.cli.main import app
from typer.testing import CliRunner


def test_bench_index_small_runs_and_reports():
    result = CliRunner().invoke(app, ["bench", "index", "--json", "--blocks", "3000", "--lookups", "50"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["restart_blocks"] == out["indexed_blocks"] > 2000
    assert out["lookup_in_process"]["cpu"]["p99_ms"] > 0 and out["lookup_nats"]["p99_ms"] > 0
    assert out["ingest_in_process"]["blocks_per_s"] > 0 and out["restart_to_ready_s"] > 0
