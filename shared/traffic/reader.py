"""Read the TRAFFIC stream back: every `TrafficRecord` since a time, as it stood when the read began.

`read_records(js, since)` makes an ephemeral pull consumer (no acks) that
starts at `since` (unix seconds; None: the stream's first record), takes
the count the server says is pending at that moment and fetches exactly
that many, so a read ends when it has the snapshot, not after a quiet
timeout; records published meanwhile belong to the next read. A payload
that does not parse (another schema version) is skipped and counted in
`ReadResult.skipped`, never a failure of the whole read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime

from kvmesh.protocol import subjects
from kvmesh.protocol.base import ProtocolError
from kvmesh.protocol.streams import TRAFFIC
from kvmesh.protocol.traffic import TrafficRecord
from nats.js import JetStreamContext, api

FETCH_BATCH = 512
FETCH_TIMEOUT_S = 5.0  # per batch; the messages are already in the stream


@dataclass(slots=True)
class ReadResult:
    records: list[TrafficRecord] = field(default_factory=list)
    skipped: int = 0  # payloads of another schema version or malformed


def iso_utc(unix_s: float) -> str:
    """A JetStream start time (RFC 3339, UTC) for unix seconds."""
    return datetime.fromtimestamp(unix_s, UTC).isoformat().replace("+00:00", "Z")


def _start(since: float | None) -> api.ConsumerConfig:
    config = api.ConsumerConfig(ack_policy=api.AckPolicy.NONE, inactive_threshold=30.0,
                                filter_subject=subjects.TRAFFIC_ALL)
    if since is None:
        config.deliver_policy = api.DeliverPolicy.ALL
    else:
        config.deliver_policy = api.DeliverPolicy.BY_START_TIME
        config.opt_start_time = iso_utc(since)
    return config


async def read_all(js: JetStreamContext, since: float | None = None, limit: int | None = None) -> ReadResult:
    """The records stored from `since` on (at most `limit`, the oldest first), and how many were skipped."""
    out = ReadResult()
    sub = await js.pull_subscribe(subjects.TRAFFIC_ALL, stream=TRAFFIC.name, config=_start(since))
    try:
        pending = (await sub.consumer_info()).num_pending
        if limit is not None:
            pending = min(pending, limit)
        while pending > 0:
            for msg in await sub.fetch(min(FETCH_BATCH, pending), timeout=FETCH_TIMEOUT_S):
                pending -= 1
                try:
                    record = TrafficRecord.from_bytes(msg.data)
                except ProtocolError:
                    out.skipped += 1
                    continue
                if since is None or record.at >= since:  # the stream's time is the publish, `at` the arrival
                    out.records.append(record)
    finally:
        await sub.unsubscribe()
    return out


async def read_records(js: JetStreamContext, since: float | None = None) -> list[TrafficRecord]:
    """The records stored from `since` (unix seconds; None: all the stream keeps), oldest first."""
    return (await read_all(js, since)).records
