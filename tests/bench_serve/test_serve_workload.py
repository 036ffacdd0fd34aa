"""The `kvmesh bench serve` workload and statistics (the bench itself runs stacks: not a unit test)."""

from __future__ import annotations

from pathlib import Path

from kvmesh.bench.serve import Sample, _pct, summarize
from kvmesh.bench.serve_workload import TRAJ_DIR, build_workload


def test_synthetic_workload_is_deterministic_and_distinct(tmp_path: Path) -> None:
    a = build_workload(3, 4, tmp_path)  # no trajectories under tmp_path
    assert a.source == "synthetic" and a == build_workload(3, 4, tmp_path)
    assert len(a.sessions) == 3 and all(len(s.turns) == 4 for s in a.sessions) and a.requests == 12
    assert len({s.turns[0] for s in a.sessions}) == 3  # every session is its own conversation
    assert len(a.system) > 1000 and {t["function"]["name"] for t in a.tools} == {"bash", "open_file", "edit"}


def test_trajectory_workload(tmp_path: Path) -> None:
    traj = tmp_path / "repo" / TRAJ_DIR
    traj.mkdir(parents=True)
    history = [{"role": "system", "content": "SYS " * 1000}] + [
        {"role": r, "content": f"{r} {i} " * 200} for i in range(4) for r in ("assistant", "user")]
    (traj / "one.traj").write_text(__import__("json").dumps({"history": history}))
    w = build_workload(2, 3, tmp_path / "repo", system_chars=500, turn_chars=50)
    assert w.source == "swe-agent" and w.system == ("SYS " * 1000)[:500]
    assert [len(s.turns) for s in w.sessions] == [3, 3] and w.sessions[0].turns[1].startswith("user 1")
    assert w.sessions[0].turns[0] != w.sessions[1].turns[0]
    assert build_workload(2, 9, tmp_path / "repo").source == "synthetic"  # too few turns in the file


def test_summary() -> None:
    samples = [Sample(0.1 * i, 0.1 * i + 0.15, 100, 50, 16, "x") for i in range(1, 11)]
    s = summarize(samples, wall=2.0)
    assert s["requests"] == 10 and s["cached_token_ratio"] == 0.5 and s["output_tokens_per_s"] == 80.0
    assert s["ttft_ms_p50"] in (500.0, 600.0) and s["ttft_ms_p99"] == 1000.0 and s["tpot_ms_p50"] == 10.0
    assert s["ttft_ms_mean"] == 550.0
    assert _pct([], 0.5) == 0.0
