"""Where a kvmesh request's time goes, from the client's token times and the prefill worker's own spans.

The prefill worker logs one line per request (shared/serving/prefill_worker.py) at its end: `prefilled`
when it hands the request off, `decoded here` when it decodes it too. The line holds its wall-clock
timestamp and the milliseconds of each span, in order up to that timestamp (`reach`: finding and
restoring cached blocks, `engine`: queueing in the engine and the prefill itself, `token0`: publishing
token 1, or `decode` and `finish` for the rest of a request decoded there, `store`: registering the
blocks afterwards). Joined with the client's send time and token arrivals on the request id (the
completion id's hex), on one box and one clock:

- `to_prefill`: send -> the prefill worker starts (HTTP, admission, prompt rendering, routing with its
  cache-index lookup, the JetStream hop, waiting for the worker);
- `reach`, `engine`, `token0`: the spans above;
- `token1_delivery`: token 1 published -> at the client (the token hop back and the SSE write);
- `handoff`: the gap between tokens 1 and 2 beyond a steady token (decode fetching the KV and starting;
  about 0 for a request decoded on its prefill worker);
- `tpot`: the median gap between later tokens.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

from kvmesh.bench.peer_drive import Timing, pct

STAGES = ("to_prefill", "reach", "engine", "token0", "token1_delivery", "handoff", "tpot", "store")
LINES = ("prefilled", "decoded here")


def logged(log_dir: Path, pattern: str, events: tuple[str, ...]) -> Iterator[dict]:
    """The JSON log records of `events` with a request id, from the service logs matching `pattern`."""
    for path in sorted(log_dir.glob(pattern)):
        for line in path.read_text(errors="replace").splitlines():
            if not any(f'"{event}"' in line for event in events):
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("event") in events and str(rec.get("request_id", "")).startswith("req_"):
                yield rec


def prefill_spans(log_dir: Path) -> dict[str, tuple[float, dict]]:
    """request hex -> (the worker's line's epoch seconds, its ms spans); the first attempt's line."""
    out: dict[str, tuple[float, dict]] = {}
    for rec in logged(log_dir, "prefill-*.log", LINES):
        at = datetime.fromisoformat(rec["timestamp"].replace("Z", "+00:00")).timestamp()
        out.setdefault(rec["request_id"].removeprefix("req_"), (at, rec.get("ms") or {}))
    return out


def request_stages(t: Timing, line: tuple[float, dict]) -> dict[str, float]:
    at, ms = line
    span = {k: float(ms.get(k, 0.0)) / 1000 for k in ("reach", "engine", "token0", "store")}
    started = at - sum(float(v) for v in ms.values()) / 1000
    token1_out = started + span["reach"] + span["engine"] + span["token0"]
    stages = {"to_prefill": started - t.sent, **span, "token1_delivery": t.token_times[0] - token1_out}
    timed = handoff_and_tpot(t)
    if timed is not None:
        stages |= {"handoff": timed[0], "tpot": timed[1]}
    return stages


def handoff_and_tpot(t: Timing) -> tuple[float, float] | None:
    """(the gap between tokens 1 and 2 beyond a steady token, the steady token: the median later gap);
    None with fewer than 4 tokens."""
    gaps = [b - a for a, b in zip(t.token_times, t.token_times[1:], strict=False)]
    if len(gaps) < 3:
        return None
    steady = statistics.median(gaps[1:])
    return gaps[0] - steady, steady


def breakdown(timings: list[Timing], log_dir: Path) -> dict:
    """Per stage p50 and mean seconds over the requests that could be joined, per workload."""
    spans = prefill_spans(log_dir)
    out: dict[str, dict] = {}
    for workload in sorted({t.workload for t in timings}):
        rows = [request_stages(t, spans[key]) for t in timings if t.workload == workload and t.ok
                and (key := t.request_id.rpartition("-")[2]) in spans]
        if not rows:
            continue
        out[workload] = {"requests": len(rows), **{
            stage: {"p50_s": round(pct(vals, 0.5), 4), "mean_s": round(statistics.fmean(vals), 4)}
            for stage in STAGES if (vals := [r[stage] for r in rows if stage in r])}}
    return out
