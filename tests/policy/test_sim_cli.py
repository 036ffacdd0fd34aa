"""`kvmesh sim` end to end: a generated trace file, and the shared Mooncake trace's head."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from kvmesh.cli.main import app
from typer.testing import CliRunner

REPO_ROOT = Path(__file__).resolve().parents[2]
SHARED_TRACE = REPO_ROOT.parent / "shared" / "workloads" / "mooncake_synthetic_trace.jsonl"
KEYS = {"default", "cost", "lru", "lfu", "tinylfu", "session", "continuum", "s3fifo", "arc", "belady", "infinite"}


def write_trace(path: Path) -> Path:
    """Sessions that come back: each turn extends its session's previous prompt."""
    lines = []
    sessions: list[list[int]] = []
    next_id = 0
    for i in range(120):
        s = i % 7
        if s >= len(sessions):
            sessions.append([next_id])  # a system prompt block per session
            next_id += 1
        sessions[s] = sessions[s] + list(range(next_id, next_id + 2))
        next_id += 2
        ids = sessions[s]
        lines.append(json.dumps({"timestamp": 250 * i, "input_length": 512 * len(ids), "output_length": 8, "hash_ids": ids}))
    path.write_text("\n".join(lines) + "\n")
    return path


def run_sim(*args: str) -> dict:
    result = CliRunner().invoke(app, ["sim", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_sim_json_shape_on_generated_trace(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "sessions.jsonl")
    out = run_sim("--trace", str(trace), "--capacity-blocks", "40")
    assert out["trace"] == "sessions.jsonl"
    assert out["capacity_blocks"] == 40
    assert out["unique_blocks"] == 7 + 2 * 120
    assert set(out["hit_rate"]) == KEYS
    rates = out["hit_rate"]
    assert all(0.0 <= rates[k] <= rates["infinite"] for k in KEYS)
    assert rates["infinite"] > 0.5  # every turn re-sends its session's whole history


def test_sim_policy_subset_fraction_and_plot(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "sessions.jsonl")
    png = tmp_path / "plot" / "sweep.png"
    out = run_sim("--trace", str(trace), "--capacity-fraction", "1.0", "--policy", "lru", "--policy", "infinite", "--plot", str(png))
    assert set(out["hit_rate"]) == {"lru", "infinite"}
    assert out["capacity_blocks"] == out["unique_blocks"]
    assert out["hit_rate"]["lru"] == out["hit_rate"]["infinite"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sim_rejects_bad_arguments(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl")
    runner = CliRunner()
    both = runner.invoke(app, ["sim", "--trace", str(trace), "--capacity-blocks", "3", "--capacity-fraction", "0.1"])
    assert both.exit_code != 0
    unknown = runner.invoke(app, ["sim", "--trace", str(trace), "--capacity-blocks", "3", "--policy", "fifo"])
    assert unknown.exit_code != 0 and "unknown policy" in unknown.output


@pytest.mark.skipif(not SHARED_TRACE.exists(), reason=f"shared trace not beside the repo ({SHARED_TRACE.relative_to(REPO_ROOT.parent)})")
def test_sim_on_shared_trace_head(tmp_path: Path) -> None:
    head = tmp_path / "mooncake_head.jsonl"
    with SHARED_TRACE.open() as f:
        head.write_text("".join(line for _, line in zip(range(500), f)))
    out = run_sim("--trace", str(head), "--capacity-fraction", "0.03")
    rates = out["hit_rate"]
    assert set(rates) == KEYS and out["trace"] == "mooncake_head.jsonl"
    assert 0 < out["capacity_blocks"] < out["unique_blocks"]
    assert all(0.0 <= rates[k] <= rates["infinite"] for k in KEYS)
    assert 0.0 < rates["lru"] < rates["belady"]


def test_sim_tiers_ttft_and_sweep_on_an_agent_trace(tmp_path: Path) -> None:
    from tests.policy.agent_trace import write_agent_trace

    trace = write_agent_trace(tmp_path / "agent.jsonl", sessions=30, seed=2)
    out = run_sim("--trace", str(trace), "--l1-fraction", "0.05", "--l2-fraction", "0.1", "--sweep",
                  "--policy", "session", "--policy", "lru", "--policy", "continuum", "--policy", "belady")
    names = {"session", "lru", "continuum", "belady"}
    assert out["l2_capacity_blocks"] == round(0.1 * out["unique_blocks"])
    for n in names:
        assert math.isclose(out["hit_rate"][n], out["l1_hit_rate"][n] + out["l2_hit_rate"][n], abs_tol=2e-6)
        assert out["l2_hit_rate"][n] >= 0.0
        ttft = out["ttft_s"][n]
        assert 0.0 < ttft["p50"] <= ttft["p99"]
    assert set(out["prediction_error_s"]) == {"session", "continuum"}  # only session-aware policies predict
    assert out["ttft_model"]["kv_bytes_per_token"] == 131072
    sweep = out["sweep"]
    assert sweep["l1_fractions"][0] == 0.02 and sweep["l1_fractions"][-1] == 0.3
    for n in names:
        curve = sweep["l1_hit_rate"][n]
        assert len(curve) == len(sweep["l1_fractions"]) and all(0.0 <= y <= 1.0 for y in curve)


def test_sim_decode_rate_stamps_turn_ends(tmp_path: Path) -> None:
    """The decode rate is reported, moves only session-aware policies' results, and must be >= 0."""
    from tests.policy.agent_trace import write_agent_trace

    trace = write_agent_trace(tmp_path / "agent.jsonl", sessions=30, seed=2)
    args = ("--trace", str(trace), "--l1-fraction", "0.05", "--policy", "session", "--policy", "lru")
    stamped, at_arrival = run_sim(*args), run_sim(*args, "--decode-tokens-per-s", "0")
    assert stamped["decode_tokens_per_s"] == 50.0 and at_arrival["decode_tokens_per_s"] == 0.0
    assert stamped["hit_rate"]["lru"] == at_arrival["hit_rate"]["lru"]
    # the gap learnt shrinks by the decode time: the predictions differ
    assert stamped["prediction_error_s"]["session"] != at_arrival["prediction_error_s"]["session"]
    bad = CliRunner().invoke(app, ["sim", *args, "--decode-tokens-per-s", "-1"])
    assert bad.exit_code != 0
