"""`kvmesh bench soak`: the flatness judgement on its own, and a short run through `kvmesh up`."""

from __future__ import annotations

import json

import pytest
from kvmesh.bench.soak import judge
from kvmesh.cli.main import app
from typer.testing import CliRunner


def _samples(fds: list[int], rss: list[float]) -> list[dict]:
    return [{"t_s": 30.0 * i, "calls": i, "procs": {"prefill-0": {"fds": f, "rss_mb": r, "threads": 9, "maps": 400},
                                                     "gone-0": None}}
            for i, (f, r) in enumerate(zip(fds, rss, strict=True))]


def test_flat_means_fds_within_5_and_rss_within_10_percent_after_warmup() -> None:
    warm = [100, 150, 200]  # warm-up samples (t < 90 s) are left out
    steady = judge(_samples(warm + [200, 204, 198, 201], [50, 80, 100, 100, 108, 95, 100]), warmup_s=90)
    assert steady["prefill-0"]["flat"] and steady["prefill-0"]["no_growth"] and steady["prefill-0"]["fds_max"] == 204
    assert "gone-0" not in steady  # a process never seen after warm-up is not judged
    leaking = judge(_samples(warm + [200, 220, 240, 260], [50, 80, 100, 100, 100, 100, 100]), warmup_s=90)
    assert not leaking["prefill-0"]["flat"] and not leaking["prefill-0"]["no_growth"]
    growing = judge(_samples(warm + [200, 200, 200, 200], [50, 80, 100, 100, 115, 130, 145]), warmup_s=90)
    assert not growing["prefill-0"]["flat"] and not growing["prefill-0"]["no_growth"]
    # RSS that swings with batches (±30%) but does not grow: not flat, no growth
    swinging = judge(_samples(warm + [200] * 7, [50, 80, 100, 100, 130, 70, 130, 70, 100, 100]), warmup_s=90)
    assert not swinging["prefill-0"]["flat"] and swinging["prefill-0"]["no_growth"]
    # two more fds of twenty (a connection): growth by 10%, within the 2-fd floor
    stepped = judge(_samples(warm + [20, 20, 22, 22, 22], [50, 80, 100, 100, 100, 100, 100, 100]), warmup_s=90)
    assert not stepped["prefill-0"]["flat"] and stepped["prefill-0"]["no_growth"]


@pytest.mark.slow
def test_a_short_soak_through_the_stack_reports_every_process() -> None:
    result = CliRunner().invoke(app, ["bench", "soak", "--json", "--duration-s", "20", "--sessions", "2",
                                      "--sample-every-s", "5", "--warmup-s", "5", "--l2-blocks", "64"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["calls"] > 0 and out["errors"] == 0 and out["dead_letters"] == 0, out["error_samples"]
    assert len(out["samples"]) >= 3
    names = set(out["processes"])
    assert {"nats", "s3", "prefill-0", "decode-0", "ingress-0", "cache_index-0", "eviction-0"} <= names
    assert all(p["fds_max"] > 0 and p["rss_mb_max"] > 0 and p["threads_max"] > 0 for p in out["processes"].values())
    assert out["l2_evicted_blocks"] > 0  # 64 blocks of L2: the lanes' contexts do not fit


def test_retry_reasons_come_from_the_ingress_log(tmp_path) -> None:
    from kvmesh.bench.soak import retry_reasons

    (tmp_path / "ingress-0.log").write_text("\n".join([
        json.dumps({"event": "request finished", "request_id": "req_a"}),
        json.dumps({"event": "retrying request", "request_id": "req_b", "stage": "prefill", "attempt": 1,
                    "reason": "prefill worker silent", "timestamp": "t"}),
        "not json",
    ]))
    (tmp_path / "prefill-0.log").write_text(json.dumps({"event": "retrying request", "request_id": "req_c"}))
    (tmp_path / "decode-0.log").write_text("\n".join([
        json.dumps({"event": "decoded", "request_id": "req_b", "timestamp": "u", "level": "info"}),
        json.dumps({"event": "decode blocks resolved", "request_id": "req_b", "timestamp": "s", "ms": 5}),
        json.dumps({"event": "decoded", "request_id": "req_bb", "timestamp": "s"}),
    ]))
    assert retry_reasons(tmp_path) == [{
        "timestamp": "t", "request_id": "req_b", "stage": "prefill", "attempt": 1, "reason": "prefill worker silent",
        "trail": [{"log": "decode-0", "event": "decode blocks resolved", "timestamp": "s", "ms": 5},
                  {"log": "ingress-0", "event": "retrying request", "stage": "prefill", "attempt": 1,
                   "reason": "prefill worker silent", "timestamp": "t"},
                  {"log": "decode-0", "event": "decoded", "timestamp": "u"}]}]
