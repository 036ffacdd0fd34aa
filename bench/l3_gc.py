"""L3 GC pass cost on a generated bucket: the old pass (a HEAD per object) vs listing-only slices.

A real weed S3 server (`S3Server`, as the tests start it, same flags) is
filled through its S3 API by bench/l3_fill.py (signed PUTs from
`fill_procs` processes x `put_threads` connections) with objects under chunk
keys (`{fingerprint}/{namespace}/{hash}`) carrying the metadata
`L3Store.put_chunk` writes; one HEAD checks it before measuring. Bodies are
0 bytes by default (`object_bytes`): a pass reads listings and HEADs, never a
body, and an empty object needs no volume write, which halves weed's CPU per
PUT. What it does not model: a real chunk's filer entry also lists its
volume chunks (one per 4 MB, weed's -filer.maxMB), so weed reads slightly
larger entries per listed key. The first `expired`
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
object record per object); sizes past the largest measured one (1M, 10M) are
extrapolated for both from it (new: a pass is constant, a cycle is
N / keys_per_pass passes; old: linear). The S3 server's RSS (now and peak)
is recorded before and after each size's passes.
"""

from __future__ import annotations

import multiprocessing as mp
import resource
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kvmesh.bench.l3_fill import FillSpec, chunk_key, fill

FP = "fp-bench-l3gc"
TTL_S = 3600
BUCKET = "bench-l3-gc"


@dataclass(slots=True)
class L3GCBenchConfig:
    objects: tuple[int, ...] = (10_000, 100_000)
    keys_per_pass: int = 100_000  # the service's default gc_keys_per_pass
    expired: int = 1000  # objects past their TTL at the pass
    namespaces: int = 16
    object_bytes: int = 0  # a pass reads no body: 0 B skips weed's volume write, halving its fill CPU
    old_max_objects: int = 100_000  # larger sizes: the old pass is extrapolated, not run
    fill_procs: int = 2  # filling processes (the client's share is GIL bound)
    put_threads: int = 8  # connections per filling process


def run_l3_gc_bench(cfg: L3GCBenchConfig) -> dict:
    from kvmesh.stack.servers import S3Server
    from kvmesh.tiers.s3_requests import counting_client

    sizes = sorted(cfg.objects)
    with tempfile.TemporaryDirectory(prefix="kvmesh-l3gc-") as tmp:
        server = S3Server(data_dir=Path(tmp) / "s3")
        server.start()
        try:
            creds = (server.endpoint, server.access_key, server.secret_key)
            client = counting_client(*creds)
            client.make_bucket(BUCKET)
            fill_s = _fill(creds, 0, cfg.expired, cfg)
            metadata = _metadata_as_written(client, creds, cfg)
            expired_until = time.time()
            while int(time.time()) <= int(expired_until) + 1:  # Last-Modified has whole seconds
                time.sleep(0.2)
            now = int(expired_until) + 1 + TTL_S  # the first `expired` objects are past the TTL, no other
            runs, written = [], cfg.expired
            for n in sizes:
                fill_s += _fill(creds, written, n, cfg)
                written = max(written, n)
                _log(f"{n} objects in the bucket ({written / fill_s:.0f} PUT/s so far); measuring")
                run = {"objects": n, "s3_server": _server_rss_mb(server.process.pid),
                       "new_pass": _child("new", creds, now, cfg.keys_per_pass, 1),
                       "new_cycle": _child("new", creds, now, cfg.keys_per_pass, -(-n // cfg.keys_per_pass) + 1)}
                run["old"] = (_child("old", creds, now, cfg.keys_per_pass, 1) if n <= cfg.old_max_objects
                              else _extrapolate(runs, n))
                run["s3_server_after"] = _server_rss_mb(server.process.pid)
                runs.append(run)
                _log(f"{n}: new pass {run['new_pass']['seconds']} s, cycle {run['new_cycle']['seconds']} s, "
                     f"old {run['old']['seconds']} s")
            deletes = _deletes(client, cfg)
        finally:
            server.stop()
    return {"config": asdict(cfg), "fill_objects_per_s": round(written / fill_s, 1),
            "fill_seconds": round(fill_s, 1), "metadata_as_written": metadata, "runs": runs,
            "deletes": deletes, "ratios": _ratios(runs),
            "extrapolated": {str(n): _extrapolate_both(runs[-1], cfg, n) for n in (1_000_000, 10_000_000)
                             if n > runs[-1]["objects"]}}


# --- filling ---------------------------------------------------------------

def _spec(creds: tuple[str, str, str], cfg: L3GCBenchConfig) -> FillSpec:
    return FillSpec(*creds, bucket=BUCKET, fingerprint=FP, ttl_s=TTL_S, namespaces=cfg.namespaces,
                    object_bytes=cfg.object_bytes)


def _fill(creds: tuple[str, str, str], start: int, stop: int, cfg: L3GCBenchConfig) -> float:
    """PUT objects `start..stop-1` in steps of 100k (progress on stderr); seconds taken."""
    spent = 0.0
    for lo in range(start, stop, 100_000):
        spent += fill(_spec(creds, cfg), lo, min(lo + 100_000, stop), cfg.fill_procs, cfg.put_threads)
        if stop - start > 100_000:
            _log(f"filled {min(lo + 100_000, stop)} / {stop} ({(min(lo + 100_000, stop) - start) / spent:.0f}/s)")
    return spent


def _metadata_as_written(client, creds: tuple[str, str, str], cfg: L3GCBenchConfig) -> dict[str, str]:
    """One filled object's metadata as a HEAD returns it; raises if it is not what `L3Store.put_chunk` writes."""
    key = chunk_key(_spec(creds, cfg), 0)
    stat = client.stat_object(BUCKET, key)
    meta = {k.lower().removeprefix("x-amz-meta-"): v for k, v in (stat.metadata or {}).items()
            if k.lower().startswith("x-amz-meta-")}
    want = {"namespace": key.split("/")[1], "ttl-s": str(TTL_S), "blocks": "16", "fingerprint": FP}
    if {k: meta.get(k) for k in want} != want or "last-access" not in meta or stat.size != cfg.object_bytes:
        raise RuntimeError(f"filled object {key}: metadata {meta}, size {stat.size}")
    return meta


def _server_rss_mb(pid: int) -> dict[str, float]:
    """The S3 server's resident memory now and at its peak (VmRSS, VmHWM)."""
    got = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            got[name] = round(int(value.split()[0]) / 1024, 1)
    return {"rss_mb": got.get("VmRSS", 0.0), "rss_peak_mb": got.get("VmHWM", 0.0)}


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
    from kvmesh.cache_policy.registry import get_policy
    from kvmesh.eviction.l3_gc import GCLimits, plan_gc, scan
    from kvmesh.eviction.l3_sweep import L3Sweep
    from kvmesh.tiers.l3_store import L3Store
    from kvmesh.tiers.s3_requests import counting_client

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

    spec = _spec(("", "", ""), cfg)
    keys = [chunk_key(spec, i) for i in range(cfg.expired)]
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
