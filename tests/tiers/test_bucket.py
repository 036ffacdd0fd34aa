"""ensure_bucket: a bucket it creates takes a write before it returns; S3's transient answers are retried."""

from __future__ import annotations

import uuid

import pytest
from kvmesh.tiers.bucket import PROBE_KEY, ensure_bucket
from minio.error import S3Error


def _error(code: str) -> S3Error:
    return S3Error(None, code, f"{code} from the test", "/b/k", "req", "host")


class FailingPuts:
    """The real client; its first `failures` PUTs answer with `code` instead of reaching the server."""

    def __init__(self, client, code: str, failures: int) -> None:
        self.client, self.code, self.left, self.puts = client, code, failures, 0

    def put_object(self, *args, **kwargs):
        self.puts += 1
        if self.left:
            self.left -= 1
            raise _error(self.code)
        return self.client.put_object(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.client, name)


def test_a_new_bucket_is_created_probed_and_left_empty(s3_server) -> None:
    client, bucket = s3_server.client(), f"b-{uuid.uuid4().hex[:12]}"
    assert ensure_bucket(client, bucket) is True
    assert client.bucket_exists(bucket)
    assert list(client.list_objects(bucket, recursive=True)) == []  # the probe is gone
    assert ensure_bucket(client, bucket) is False  # present: trusted as it is


def test_transient_answers_to_the_probe_are_retried(s3_server) -> None:
    client = FailingPuts(s3_server.client(), "InternalError", failures=2)
    bucket = f"b-{uuid.uuid4().hex[:12]}"
    assert ensure_bucket(client, bucket) is True
    assert client.puts == 3
    with pytest.raises(S3Error, match="NoSuchKey|does not exist"):
        s3_server.client().stat_object(bucket, PROBE_KEY)


def test_a_lasting_or_non_transient_answer_is_raised(s3_server) -> None:
    denied = FailingPuts(s3_server.client(), "AccessDenied", failures=1)
    with pytest.raises(S3Error, match="AccessDenied"):
        ensure_bucket(denied, f"b-{uuid.uuid4().hex[:12]}")
    assert denied.puts == 1  # not retried
    down = FailingPuts(s3_server.client(), "ServiceUnavailable", failures=1_000)
    with pytest.raises(S3Error, match="ServiceUnavailable"):
        ensure_bucket(down, f"b-{uuid.uuid4().hex[:12]}", timeout_s=0.3)
    assert 1 < down.puts < 1_000
