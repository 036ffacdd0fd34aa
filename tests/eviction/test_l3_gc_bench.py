"""`kvmesh bench l3-gc` at a tiny size: both passes find the same expired set; only the old one HEADs every object."""

from __future__ import annotations

from bench.l3_gc import L3GCBenchConfig, run_l3_gc_bench


def test_bench_counts_a_head_per_object_old_and_per_candidate_new() -> None:
    cfg = L3GCBenchConfig(objects=(300,), keys_per_pass=200, expired=60, namespaces=4, put_threads=8)
    out = run_l3_gc_bench(cfg)
    run = out["runs"][0]
    old, new_pass, cycle = run["old"], run["new_pass"], run["new_cycle"]
    assert old["objects_listed"] == cycle["objects_listed"] == 300 and new_pass["objects_listed"] == 200
    assert old["expired"] == cycle["expired"] == 60
    assert old["requests"] == {"LIST": 1, "HEAD": 300}
    assert cycle["passes"] == 2 and cycle["requests"] == {"LIST": 2, "HEAD": 60}  # a HEAD per candidate only
    assert new_pass["requests"]["LIST"] == 1 and new_pass["requests"]["HEAD"] == new_pass["expired"]
    assert out["deletes"]["old"]["requests"] == 30 and out["deletes"]["new"]["requests"] == 1
    assert out["deletes"]["left"] == 0
    assert set(out["extrapolated"]) == {"1000000", "10000000"}
