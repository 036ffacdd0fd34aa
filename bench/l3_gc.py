"""L3 GC pass cost on a generated bucket: the old pass (a HEAD per object) vs listing-only slices.

A real weed S3 server (`S3Server`, as the tests start it) is filled with
small objects under chunk keys (`{fingerprint}/{namespace}/{hash}`, the
metadata `L3Store.put_chunk` writes) by parallel PUTs. The first `expired`
objects are written, then the clock passes a second, then the rest: at the
pass's `now` exactly those are past the TTL. At each bucket size:

- `old`: `l3_gc.scan` (list + one HEAD per object, what the service ran
  every 60 s before) and `plan_gc` over the whole bucket;
- `new_pass`: one `L3Sweep` slice of `keys_per_pass` keys (listing only, a
  HEAD per TTL candidate) and `plan_gc`; `new_cycle`: the passes that cover
  the whole bucket once.

Each runs in a fresh child process, so its peak RSS is its own (the
interpreter and imports are `rss_base_mb`). Requests are counted in the SDK
(`CountingMinio`). Plans are not applied (every size sees the same expired
set); deletes are measured once apart: one DELETE per key (old) vs S3
DeleteObjects, 1,000 keys a request (new). Sizes past `old_max_objects`
skip the old pass and extrapolate it linearly (its cost is one HEAD and one
object record per object); 1M and 10M are extrapolated for both from the largest
measured size (new: a pass is constant, a cycle is N / keys_per_pass
passes; old: linear).
"""

from __future__ import annotations

import hashlib
import io
import multiprocessing as mp
import resource
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

FP = "fp-bench-l3gc"
TTL_S = 3600
BUCKET = "bench-l3-gc"


@dataclass(slots=True)
class L3GCBenchConfig:
    objects: tuple[int, ...] = (10_000, 100_000)
    keys_per_pass: int = 100_000  # the service's default gc_keys_per_pass
    expired: int = 1000  # objects past their TTL at the pass
    namespaces: int = 16
    object_bytes: int = 256
    old_max_objects: int = 100_000  # larger sizes: the old pass is extrapolated, not run
    put_threads: int = 32


def run_l3_gc_bench(cfg: L3GCBenchConfig) -> dict:
    from shared.stack.servers import S3Server
    from shared.tiers.s3_requests import counting_client

    sizes = sorted(cfg.objects)
    with tempfile.TemporaryDirectory(prefix="kvmesh-l3gc-") as tmp:
        server = S3Server(data_dir=Path(tmp) / "s3")
        server.start()
        try:
            creds = (server.endpoint, server.access_key, server.secret_key)
            client = counting_client(*creds, pool_size=cfg.put_threads)
            client.make_bucket(BUCKET)
            fill_s = _fill(client, 0, cfg.expired, cfg)
            expired_until = time.time()
            while int(time.time()) <= int(expired_until) + 1:  # Last-Modified has whole seconds
                time.sleep(0.2)
            now = int(expired_until) + 1 + TTL_S  # the first `expired` objects are past the TTL, no other
            runs, written = [], cfg.expired
            for n in sizes:
                fill_s += _fill(client, written, n, cfg)
                written = max(written, n)
                _log(f"{n} objects in the bucket; measuring")
                run = {"objects": n,
                       "new_pass": _child("new", creds, now, cfg.keys_per_pass, 1),
                       "new_cycle": _child("new", creds, now, cfg.keys_per_pass, -(-n // cfg.keys_per_pass) + 1)}
                run["old"] = (_child("old", creds, now, cfg.keys_per_pass, 1) if n <= cfg.old_max_objects
                              else _extrapolate(runs, n))
                runs.append(run)
            deletes = _deletes(client, cfg)
        finally:
            server.stop()
    return {"config": asdict(cfg), "fill_objects_per_s": round(written / fill_s, 1), "runs": runs,
            "deletes": deletes, "ratios": _ratios(runs),
            "extrapolated": {str(n): _extrapolate_both(runs[-1], cfg, n) for n in (1_000_000, 10_000_000)
                             if n > runs[-1]["objects"]}}


# --- filling ---------------------------------------------------------------

def _fill(client, start: int, stop: int, cfg: L3GCBenchConfig) -> float:
    if stop <= start:
        return 0.0
    body = bytes(cfg.object_bytes)
    t0 = time.perf_counter()

    def put(i: int) -> None:
        ns = f"t-{i % cfg.namespaces}"
        meta = {"namespace": ns, "ttl-s": str(TTL_S), "last-access": f"{time.time():.0f}", "blocks": "16",
                "fingerprint": FP}
        client.put_object(BUCKET, _key(i, ns), io.BytesIO(body), len(body), metadata=meta)
    with ThreadPoolExecutor(cfg.put_threads) as pool:
        for k, _ in enumerate(pool.map(put, range(start, stop), chunksize=256)):
            if k and k % 50_000 == 0:
                _log(f"filled {start + k} / {stop}")
    return time.perf_counter() - t0


def _key(i: int, ns: str) -> str:
    return f"{FP}/{ns}/{hashlib.sha256(i.to_bytes(8, 'little')).hexdigest()}"


# --- one measured pass, in a child process ------------------------------------

def _child(kind: str, creds: tuple[str, str, str], now: float, keys_per_pass: int, passes: int) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_measure, args=(queue, kind, creds, now, keys_per_pass, passes))
    proc.start()
    got = queue.get()
    proc.join()
    return got


def _measure(queue, kind: str, creds: tuple[str, str, str], now: float, keys_per_pass: int, passes: int) -> None:
    from shared.cache_policy.registry import get_policy
    from shared.eviction.l3_gc import GCLimits, plan_gc, scan
    from shared.eviction.l3_sweep import L3Sweep
    from shared.tiers.l3_store import L3Store
    from shared.tiers.s3_requests import counting_client

    store = L3Store(counting_client(*creds), BUCKET, fingerprint=FP, ttl_s=TTL_S)
    policy, never = get_policy("cost"), (lambda o: False)
    base = _maxrss_mb()
    t0 = time.perf_counter()
    listed = expired = 0
    if kind == "old":
        objects = scan(store)
        listed, expired = len(objects), len(plan_gc(objects, GCLimits(), policy, now, never).expired)
        done = 1
    else:
        sweep = L3Sweep(store, keys_per_pass)
        for done in range(1, passes + 1):
            part = sweep.next_slice()
            objects = sweep.confirm(part.objects, now)
            listed += len(part.objects)
            expired += len(plan_gc(objects, GCLimits(), policy, now, never).expired)
            sweep.finish(part, objects)
            if part.wrapped:
                break
    seconds = time.perf_counter() - t0
    queue.put({"passes": done, "objects_listed": listed, "expired": expired, "seconds": round(seconds, 3),
               "requests": dict(store.client.requests), "rss_base_mb": round(base, 1),
               "rss_peak_mb": round(_maxrss_mb(), 1), "rss_pass_mb": round(_maxrss_mb() - base, 1)})


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# --- deletes, extrapolation, ratios -------------------------------------------

def _deletes(client, cfg: L3GCBenchConfig) -> dict:
    """Delete the expired objects: half one request per key (old), half in DeleteObjects batches (new)."""
    from minio.deleteobjects import DeleteObject

    keys = [_key(i, f"t-{i % cfg.namespaces}") for i in range(cfg.expired)]
    half = len(keys) // 2
    client.reset()
    t0 = time.perf_counter()
    for key in keys[:half]:
        client.remove_object(BUCKET, key)
    old_s, old_req = time.perf_counter() - t0, sum(client.reset().values())
    t0 = time.perf_counter()
    errors = list(client.remove_objects(BUCKET, (DeleteObject(k) for k in keys[half:])))
    new_s, new_req = time.perf_counter() - t0, sum(client.reset().values())
    left = sum(1 for k in keys if _exists(client, k))
    return {"keys_each": half, "left": left, "old": {"requests": old_req, "seconds": round(old_s, 3)},
            "new": {"requests": new_req, "seconds": round(new_s, 3), "errors": len(errors)}}


def _exists(client, key: str) -> bool:
    from minio.error import S3Error

    try:
        client.stat_object(BUCKET, key)
    except S3Error:
        return False
    return True


def _extrapolate(runs: list[dict], n: int) -> dict:
    """The old pass at `n` objects, linear from the largest measured one (one HEAD, one record per object)."""
    last = next(r for r in reversed(runs) if not r["old"].get("extrapolated"))
    m, old = last["objects"], last["old"]
    f = n / m
    return {"extrapolated": True, "from_objects": m, "seconds": round(old["seconds"] * f, 1),
            "requests": {k: round(v * f) for k, v in old["requests"].items()},
            "rss_pass_mb": round(old["rss_pass_mb"] * f, 1)}


def _extrapolate_both(last: dict, cfg: L3GCBenchConfig, target: int) -> dict:
    """Both designs at `target` objects from the largest measured size: the old pass and a new cycle grow
    linearly (a HEAD and a record per object; a LIST per 1,000 keys); a new pass is the same slice."""
    n, f = last["objects"], target / last["objects"]
    old, cyc = last["old"], last["new_cycle"]
    passes = -(-target // cfg.keys_per_pass)
    return {"from_objects": n,
            "old_pass": {"seconds": round(old["seconds"] * f, 1), "head_requests": target,
                         "rss_pass_mb": round(old["rss_pass_mb"] * f, 1)},
            "new_pass": {"seconds": last["new_pass"]["seconds"], "rss_pass_mb": last["new_pass"]["rss_pass_mb"],
                         "list_requests": -(-cfg.keys_per_pass // 1000)},
            "new_cycle": {"passes": passes, "seconds": round(cyc["seconds"] * f, 1),
                          "list_requests": -(-target // 1000) + passes}}


def _ratios(runs: list[dict]) -> dict:
    out = {}
    for r in runs:
        old, new = r["old"], r["new_pass"]
        out[str(r["objects"])] = {
            "old_over_new_pass_seconds": round(old["seconds"] / max(new["seconds"], 1e-9), 1),
            "old_over_new_cycle_seconds": round(old["seconds"] / max(r["new_cycle"]["seconds"], 1e-9), 1),
            "old_over_new_pass_requests": round(sum(old["requests"].values()) / max(sum(new["requests"].values()), 1), 1),
        }
    return out


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
