"""L3 read touches: which reads refresh an object, how many may wait, and a flush that finds one gone."""

from __future__ import annotations

from email.utils import formatdate

from kvmesh.tiers.l3_touch import L3Touches
from kvmesh.tiers.s3_client import fast_fail_client

NOW = 1_800_000_000.0


def _headers(age_s: float, ttl_s: int | None = None) -> dict[str, str]:
    out = {"Last-Modified": formatdate(NOW - age_s, usegmt=True), "X-Amz-Meta-namespace": "t"}
    if ttl_s is not None:
        out["X-Amz-Meta-ttl-s"] = str(ttl_s)
    return out


def test_only_objects_older_than_the_share_of_their_own_ttl_are_refreshed() -> None:
    touches = L3Touches(refresh_share=0.5)
    assert not touches.note("a", _headers(age_s=40), default_ttl_s=100, now=NOW)  # 40 < 50
    assert touches.note("b", _headers(age_s=60), default_ttl_s=100, now=NOW)
    assert not touches.note("c", _headers(age_s=60, ttl_s=1000), default_ttl_s=100, now=NOW)  # its own TTL
    assert not touches.note("d", {"X-Amz-Meta-ttl-s": "1"}, default_ttl_s=100, now=NOW)  # no date: no claim
    assert touches.pending() == 1 and touches.stats.noted == 1


def test_pending_touches_are_bounded_and_drops_counted() -> None:
    touches = L3Touches(refresh_share=0.5, max_pending=2)
    for key in ("a", "b", "c", "a"):
        touches.note(key, _headers(age_s=90), default_ttl_s=100, now=NOW)
    assert touches.pending() == 2 and touches.stats.dropped == 1  # "c"; "a" again was already pending


def test_a_flush_of_an_object_gone_meanwhile_counts_a_failure_and_goes_on(s3_server) -> None:
    client = fast_fail_client(s3_server.endpoint, s3_server.access_key, s3_server.secret_key)
    bucket = "touch-gone-0001"
    if not client.bucket_exists(bucket):
        client.make_bucket(bucket)
    touches = L3Touches(refresh_share=0.5)
    touches.note("fp/t/00ff", _headers(age_s=90), default_ttl_s=100, now=NOW)
    assert touches.flush(client, bucket) == 0
    assert touches.stats.copies == 1 and touches.stats.failed == 1 and touches.pending() == 0
