"""`kvmesh bench l3-gc` at a tiny size: both passes find the same expired set; only the old one HEADs every
object. Its filler's signed PUTs land (keys, bodies, metadata) and a wrong secret is refused."""

from __future__ import annotations

import uuid

import pytest
from kvmesh.bench.l3_fill import FillSpec, chunk_key, fill
from kvmesh.bench.l3_gc import L3GCBenchConfig, run_l3_gc_bench


def test_bench_counts_a_head_per_object_old_and_per_candidate_new() -> None:
    cfg = L3GCBenchConfig(objects=(300,), keys_per_pass=200, expired=60, namespaces=4, fill_procs=2, put_threads=4)
    out = run_l3_gc_bench(cfg)
    assert out["metadata_as_written"]["blocks"] == "16"  # the fill's signed PUTs carry put_chunk's metadata
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


def test_fill_puts_signed_objects_weed_accepts_and_refuses_a_wrong_secret(s3_server) -> None:
    bucket = f"fill-{uuid.uuid4().hex[:8]}"
    client = s3_server.client()
    client.make_bucket(bucket)
    spec = FillSpec(s3_server.endpoint, s3_server.access_key, s3_server.secret_key, bucket=bucket,
                    fingerprint="fp-fill", ttl_s=60, namespaces=3, object_bytes=100)
    fill(spec, 0, 40, procs=2, threads=3)
    keys = sorted(o.object_name for o in client.list_objects(bucket, recursive=True))
    assert keys == sorted(chunk_key(spec, i) for i in range(40))
    got = client.get_object(bucket, chunk_key(spec, 7))
    try:
        assert got.read() == bytes(100) and got.headers["x-amz-meta-namespace"] == "t-1"
    finally:
        got.close()
        got.release_conn()
    wrong = FillSpec(s3_server.endpoint, s3_server.access_key, "not-the-secret", bucket=bucket,
                     fingerprint="fp-fill", ttl_s=60, namespaces=3, object_bytes=0)
    with pytest.raises(RuntimeError, match="HTTP 403"):
        fill(wrong, 40, 41, procs=1, threads=1)
    assert sum(1 for _ in client.list_objects(bucket, recursive=True)) == 40
