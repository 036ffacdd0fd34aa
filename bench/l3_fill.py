"""Fill a bucket with generated L3 chunk objects fast: signed PUTs over plain http.client, from processes.

Used by `kvmesh bench l3-gc` to build buckets of 1M objects through the real
S3 server (so the listing a GC pass reads is weed's own). Where the time went
with the minio SDK (measured at 5k objects on this 2-core box, weed's CPU
and the client's per object): a 256 B PUT cost weed 0.77 ms and the SDK
0.55 ms, one process with 32 threads reached ~540 objects/s; a 0-byte body
costs weed 0.37-0.46 ms (no volume write: the filer entry holds no chunk),
and a request signed here costs the client 0.22 ms. Python's share is GIL
bound, so the work is split over processes, each with a few threads and one
kept-alive connection per thread: 2 processes x 8 threads reached ~2,300
objects/s where one process with 8 threads reached ~1,200.

Every object carries the metadata `L3Store.put_chunk` writes (namespace,
ttl-s, last-access, blocks, fingerprint; content type
application/octet-stream) under a chunk key `{fingerprint}/{namespace}/
{hash}`. Requests are AWS Signature V4 with the payload's SHA-256 (weed
checks both), signed by the minio SDK's signer: only the HTTP round trip
is done here, on a kept-alive connection per thread.
"""

from __future__ import annotations

import hashlib
import http.client
import multiprocessing as mp
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from urllib.parse import urlsplit

from minio import time as minio_time
from minio.credentials import Credentials
from minio.signer import sign_v4_s3

REGION = "us-east-1"


@dataclass(frozen=True, slots=True)
class FillSpec:
    endpoint: str  # host:port
    access_key: str
    secret_key: str
    bucket: str
    fingerprint: str
    ttl_s: int
    namespaces: int
    object_bytes: int
    blocks: int = 16


def chunk_key(spec: FillSpec, i: int) -> str:
    """Object `i`'s key: namespace `t-{i % namespaces}`, a hash of `i` (keys spread over the key space)."""
    ns = f"t-{i % spec.namespaces}"
    return f"{spec.fingerprint}/{ns}/{hashlib.sha256(i.to_bytes(8, 'little')).hexdigest()}"


def fill(spec: FillSpec, start: int, stop: int, procs: int, threads: int) -> float:
    """PUT objects `start..stop-1` from `procs` processes of `threads` connections each; seconds taken.

    Raises RuntimeError on any answer but 200 (nothing is retried: a bench bucket missing objects would
    measure the wrong size).
    """
    if stop <= start:
        return 0.0
    procs = max(1, min(procs, stop - start))
    t0 = time.perf_counter()
    if procs == 1:
        _put_range(spec, start, stop, 1, threads)
    else:
        with mp.get_context("spawn").Pool(procs) as pool:
            pool.starmap(_put_range, [(spec, start + k, stop, procs, threads) for k in range(procs)])
    return time.perf_counter() - t0


def _put_range(spec: FillSpec, start: int, stop: int, step: int, threads: int) -> int:
    ids = range(start, stop, step)
    threads = max(1, min(threads, len(ids)))
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda t: _put_each(spec, ids[t::threads]), range(threads)))
    return len(ids)


def _put_each(spec: FillSpec, ids: range) -> None:
    host, port = spec.endpoint.rsplit(":", 1)
    body = bytes(spec.object_bytes)
    body_sha = hashlib.sha256(body).hexdigest()
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        for i in ids:
            key = chunk_key(spec, i)
            meta = {"content-length": str(len(body)), "content-type": "application/octet-stream",
                    "x-amz-meta-namespace": key.split("/")[1], "x-amz-meta-ttl-s": str(spec.ttl_s),
                    "x-amz-meta-last-access": f"{time.time():.0f}", "x-amz-meta-blocks": str(spec.blocks),
                    "x-amz-meta-fingerprint": spec.fingerprint}
            path = f"/{spec.bucket}/{key}"  # keys are [0-9a-z/-]: nothing to percent-encode
            conn.request("PUT", path, body=body, headers=sign_v4("PUT", spec, path, meta, body_sha))
            resp = conn.getresponse()
            answer = resp.read()
            if resp.status != 200:
                raise RuntimeError(f"PUT {key}: HTTP {resp.status} {answer[:300]!r}")
    finally:
        conn.close()


def sign_v4(method: str, spec: FillSpec, path: str, headers: dict[str, str], payload_sha: str) -> dict[str, str]:
    """`headers` plus host, date, payload hash and the SigV4 Authorization (the minio SDK's own signer)."""
    date = datetime.now(timezone.utc)
    signed = {**headers, "Host": spec.endpoint, "x-amz-date": minio_time.to_amz_date(date),
              "x-amz-content-sha256": payload_sha}
    return sign_v4_s3(method=method, url=urlsplit(f"http://{spec.endpoint}{path}"), region=REGION, headers=signed,
                      credentials=Credentials(spec.access_key, spec.secret_key), content_sha256=payload_sha, date=date)
