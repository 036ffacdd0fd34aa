"""`kvmesh bench fleet` end to end on a tiny fleet: real nats-server, index, eviction and router processes."""

from __future__ import annotations

import json
from pathlib import Path

from kvmesh.bench.fleet import lookup_legs
from kvmesh.cli.main import app
from typer.testing import CliRunner


def _tiny_trace(path: Path) -> Path:
    """Twelve requests, two conversations growing turn by turn (shared leading ids), 0.2 s apart."""
    lines = []
    for i in range(12):
        conv, turn = i % 2, i // 2
        ids = [conv * 1000 + j for j in range(4 + 2 * turn)]
        lines.append(json.dumps({"timestamp": 200 * i, "input_length": 512 * len(ids), "output_length": 8,
                                 "hash_ids": ids}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_bench_fleet_small_runs_and_reports(tmp_path):
    trace = _tiny_trace(tmp_path / "trace.jsonl")
    result = CliRunner().invoke(app, ["bench", "fleet", "--json", "--workers", "5,20", "--trace", str(trace),
                                      "--speed", "4", "--lookup-rate", "10", "--l1-blocks", "16", "--churn", "10"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert [r["workers"] for r in out["rows"]] == [5, 20]
    assert out["config"]["requests"] == 12 and out["config"]["emulator_nice"] == 10
    for row in out["rows"]:
        assert row["lookup_p99_ms"] > 0 and row["lookup_failures"] == 0
        assert row["lookup_nats"]["n"] >= 12 and row["routing_decision"]["p99_ms"] > 0
        legs = row["lookup_legs"]
        assert 0 < legs["in_index"]["n"] <= row["lookup_nats"]["n"] and legs["to_index"]["p50_ms"] >= 0
        assert row["index_blocks"] > 0 and row["index_mb_per_1m_blocks"] > 0
        assert row["index_ingest_events_per_s"] > 0 and isinstance(row["ingest_keeps_up_10x"], bool)
        assert row["replay_lag"]["drain_after_replay_s"] is not None
        advice = row["eviction_advice"]
        assert advice["missed"] == 0 and advice["n"] == min(row["workers"], 12) and advice["p50_ms"] > 0, row
        assert row["nats"]["per_worker_consumers"] == row["workers"]  # one command consumer each
        assert row["nats"]["streams"] > 0 and row["nats"]["consumers"] >= row["workers"]
        assert row["churn"]["started"] == 10
        assert row["consumers_left_after_churn"] == 0
    assert out["growth"]["workers"] == 4.0 and "lookup_p99_ms" in out["growth"]


def test_bench_index_scale_mode_reports_memory_lookups_and_snapshot():
    result = CliRunner().invoke(app, ["bench", "index", "--json", "--scale", "3000,6000", "--lookups", "40",
                                      "--scale-workers", "50"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout.strip().splitlines()[-1])["rows"]
    assert [r["blocks"] for r in rows] == [2944, 5888]  # whole chains of 128
    for r in rows:
        assert r["map_bytes_per_block"] > 0 and r["blocks_per_gib"] > 0
        assert r["lookups_per_s_per_core_in_process"] > 0 and r["nats"]["lookups_per_s_per_core"] > 0
        assert r["snapshot_bytes"] > 8 * r["blocks"]  # a key and at least one mask word each


def testlookup_legs_match_each_round_trip_to_the_one_handler_span_inside_it():
    round_trips = [[0.0, 0.010], [0.020, 0.030], [0.040, 0.050]]
    spans = [[0.023, 0.024], [0.002, 0.005], [0.021, 0.022], [0.041, 0.060]]  # unordered, as gathered
    legs = lookup_legs(round_trips, spans)
    # only the first is unambiguous: the second holds two spans, the third's span ends after its reply
    assert {k: v["n"] for k, v in legs.items()} == {"to_index": 1, "in_index": 1, "back": 1}
    assert (legs["to_index"]["p50_ms"], legs["in_index"]["p50_ms"], legs["back"]["p50_ms"]) == (2.0, 3.0, 5.0)
