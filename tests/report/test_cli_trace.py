"""`kvmesh report cost --trace FILE`: a recorded JSONL in, the JSON report (and the page) out, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .factory import record, write_jsonl

KVMESH = [str(Path(sys.executable).parent / "kvmesh")]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*KVMESH, "report", "cost", *args], capture_output=True, text=True, timeout=120)


def test_json_report_of_a_recorded_trace(tmp_path: Path) -> None:
    records = [record(i * 20, 400 + 100 * i, 20, cached=100 * i, session="s", hash_ids=list(range(4 + i)))
               for i in range(7)]
    trace = write_jsonl(records, tmp_path / "served.jsonl")
    out = run("--trace", str(trace), "--json", "--html", str(tmp_path / "page" / "r.html"), "--hit-rate-target", "0.5",
              "--window-s", "40")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["measured"]["requests"] == 7
    assert report["measured"]["turns"]["mean"] == 7
    assert report["hit_rate_over_time"]["window_s"] == 40 and len(report["hit_rate_over_time"]["windows"]) == 4
    assert report["recommendation"] in ("hosted", "self_built", "kvmesh_cross_turn") and report["reasons"]
    assert set(report["cost_per_1m_tokens_usd"]) == {"openai", "anthropic", "gemini", "deepseek", "self_built",
                                                     "kvmesh_cross_turn"}
    built = report["self_built"]
    assert built["baseline"]["policy"] == "lru" and built["baseline"]["engines"] == 1
    base, kv = built["options"]
    steps = {s["source"]: s for s in built["savings"]}
    assert steps["l1_prefix_caching"]["usd"] == pytest.approx(built["no_cache"]["total_usd"] - base["total_usd"])
    assert steps["kvmesh_on_top"]["usd"] == pytest.approx(base["total_usd"] - kv["total_usd"])
    assert [Path(p).name for p in report["html"]] == ["r.html", "r-hit-rate.png", "r-cost.png"]
    assert all(Path(p).exists() for p in report["html"])


def test_a_plain_mooncake_line_is_refused(tmp_path: Path) -> None:
    trace = tmp_path / "mooncake.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}) + "\n")
    out = run("--trace", str(trace))
    assert out.returncode != 0
    assert "not a served-traffic record" in out.stderr


def test_since_keeps_only_recent_traffic(tmp_path: Path) -> None:
    trace = write_jsonl([record(0, 400)], tmp_path / "old.jsonl")  # arrived in 2026-09, long before "1h ago"
    out = run("--trace", str(trace), "--since", "1h")
    assert out.returncode == 1 and "no served traffic" in out.stderr
