"""JetStream streams, durable consumers and KV buckets, as code, with explicit limits.

`declare_all(js, replicas)` creates or updates every stream, every shared
durable consumer and the `workers` bucket; it is idempotent and safe to run
from several processes at once (the stack launcher runs it after NATS is up;
tests run it per server). Per-worker consumers are declared by the consumer
loop that uses them, through `declare_consumer`, with the same create-or-update;
they carry an inactive threshold (the server deletes one nobody fetched from
for that long) and their loop deletes them when its worker drains, so worker
churn leaves no consumers (and, in a cluster, no Raft groups) behind.

All streams use file storage (the server syncs every write: an acked message
survives a crash) and a 2-minute duplicate window for `Nats-Msg-Id`.
Token events are not stored: they travel on core NATS (`subjects.tokens`),
and `declare_all` deletes the TOKENS stream earlier versions declared
(`RETIRED_STREAMS`); see docs/serving-workers.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.protocol import subjects
from nats.js import JetStreamContext, api
from nats.js.errors import APIError, BadRequestError, NotFoundError

MiB = 1024 * 1024
GiB = 1024 * MiB
MINUTE = 60.0
HOUR = 60 * MINUTE
DAY = 24 * HOUR

_STREAM_NAME_IN_USE = 10058  # JSStreamNameExistErr: exists with another config -> update it
_STREAM_UPDATE_REFUSED = 10052  # JSStreamUpdateErrF: e.g. "can not change storage type" (a 500, yet permanent)


@dataclass(frozen=True, slots=True)
class StreamSpec:
    """One stream and its limits; `replicas` is set at declaration time (1 local, 3 in a cluster)."""

    name: str
    subjects: tuple[str, ...]
    max_age_s: float
    max_bytes: int
    max_msg_size: int
    work_queue: bool = False  # each message taken by one consumer, deleted once acked
    duplicate_window_s: float = 2 * MINUTE
    description: str = ""
    # Consumers the stream may have. nats-server caps a stream at 1,000 unless its config says more, and the
    # work queues hold a durable per worker (two per worker on JOBS): past ~500 workers new ones were refused.
    max_consumers: int = -1

    def config(self, replicas: int = 1) -> api.StreamConfig:
        return api.StreamConfig(
            name=self.name,
            description=self.description or None,
            subjects=list(self.subjects),
            retention=api.RetentionPolicy.WORK_QUEUE if self.work_queue else api.RetentionPolicy.LIMITS,
            max_age=self.max_age_s,
            max_bytes=self.max_bytes,
            max_msg_size=self.max_msg_size,
            max_msgs=-1,
            discard=api.DiscardPolicy.OLD,
            storage=api.StorageType.FILE,
            num_replicas=replicas,
            duplicate_window=min(self.duplicate_window_s, self.max_age_s),  # the server demands <= max_age
            max_consumers=self.max_consumers,
        )


@dataclass(frozen=True, slots=True)
class ConsumerSpec:
    """A durable pull consumer.

    `max_deliver` is the number of handler attempts before the consumer loop
    dead-letters a message. The server is told one more, so a message whose
    last attempt died with its process (no verdict) still comes back once and
    the loop can dead-letter it instead of the server dropping it silently.
    """

    stream: str
    durable: str
    filter_subject: str
    ack_wait_s: float = 30.0
    max_deliver: int = 5
    max_ack_pending: int = 1000
    deliver_new_only: bool = False  # True: skip what was in the stream before the consumer existed
    handler_timeout_s: float = 300.0  # a hung handler counts as a failed attempt (client side only)
    # Named after one worker: expires after `bus.worker_consumer_inactive_s` without fetches and is deleted
    # when the worker drains. Only for work-queue streams, where a deleted consumer loses nothing: the
    # messages stay in the stream for the next consumer of that subject (the same worker id, restarted).
    per_worker: bool = False
    # Handlers run at once (and so messages pulled ahead); None: the bus's `fetch_batch`. A worker's job
    # consumers take its engine's sequence budget: a request decoded on its prefill worker holds its
    # handler until the last token, and 16 at once would queue the 17th outside the engine.
    max_handlers: int | None = None

    def config(self, inactive_threshold_s: float | None = None) -> api.ConsumerConfig:
        """The server config; `inactive_threshold_s` (per-worker consumers only) is set from the bus settings."""
        return api.ConsumerConfig(
            name=self.durable,
            durable_name=self.durable,
            filter_subject=self.filter_subject,
            ack_policy=api.AckPolicy.EXPLICIT,
            ack_wait=self.ack_wait_s,
            max_deliver=self.max_deliver + 1,
            max_ack_pending=self.max_ack_pending,
            deliver_policy=api.DeliverPolicy.NEW if self.deliver_new_only else api.DeliverPolicy.ALL,
            inactive_threshold=inactive_threshold_s if self.per_worker else None,
        )


@dataclass(frozen=True, slots=True)
class BucketSpec:
    """A JetStream KV bucket whose entries carry their own TTL (`msg_ttl` on each write).

    When an entry's TTL runs out the server drops it and leaves a delete marker
    for `marker_ttl_s`, which is what lets a watcher see the key go away.
    """

    name: str
    max_bytes: int
    max_value_size: int
    history: int = 1
    marker_ttl_s: float = 60.0
    max_age_s: float = 0.0  # 0: entries live as long as their own TTL says; else a ceiling on every entry
    description: str = ""

    @property
    def stream_name(self) -> str:
        return f"KV_{self.name}"

    def config(self, replicas: int = 1) -> api.StreamConfig:
        # The stream nats-py's create_key_value would build (same fields), declared here so
        # the bucket goes through the same create-or-update path as every other stream.
        return api.StreamConfig(
            name=self.stream_name,
            description=self.description or None,
            subjects=[f"$KV.{self.name}.>"],
            allow_direct=True,
            allow_rollup_hdrs=True,
            allow_msg_ttl=True,
            subject_delete_marker_ttl=self.marker_ttl_s,
            deny_delete=True,
            discard=api.DiscardPolicy.NEW,
            duplicate_window=2 * MINUTE,
            max_age=self.max_age_s,
            max_bytes=self.max_bytes,
            max_consumers=-1,
            max_msg_size=self.max_value_size,
            max_msgs=-1,
            max_msgs_per_subject=self.history,
            num_replicas=replicas,
            storage=api.StorageType.FILE,
        )


PER_WORKER_CONSUMERS = 100_000  # streams with a durable per worker: room for tens of thousands of workers
JOBS = StreamSpec("JOBS", (subjects.JOBS_ALL,), 15 * MINUTE, 1 * GiB, 1 * MiB, work_queue=True,
                  description="ingress -> prefill/decode jobs", max_consumers=PER_WORKER_CONSUMERS)
HANDOFF = StreamSpec("HANDOFF", (subjects.HANDOFF_ALL,), 15 * MINUTE, 1 * GiB, 4 * MiB, work_queue=True,
                     description="prefill -> decode KV block handles", max_consumers=PER_WORKER_CONSUMERS)
KV_EVENTS = StreamSpec("KV_EVENTS", (subjects.KV_EVENTS_ALL,), 1 * DAY, 2 * GiB, 1 * MiB,
                       description="KV block stored/removed events for the cache index")
COMMANDS = StreamSpec("COMMANDS", (subjects.COMMANDS_ALL,), 1 * HOUR, 256 * MiB, 1 * MiB, work_queue=True,
                      description="commands to one worker: demote, delete, drain", max_consumers=PER_WORKER_CONSUMERS)
DEAD_LETTER = StreamSpec("DEAD_LETTER", (subjects.DEAD_LETTER_ALL,), 7 * DAY, 1 * GiB, 8 * MiB,
                         description="poison messages with the reason in headers")
SESSIONS = StreamSpec("SESSIONS", (subjects.SESSION_EVENTS,), 1 * DAY, 256 * MiB, 64 * 1024,
                      description="ingress -> eviction: how each agent turn ended (tool calls, answer, end)")
# A record is ~400 bytes + 20 per prompt block: 1 GiB holds about a million 30-block requests (a day at
# 10 req/s); past it the oldest go first (discard old), as past the 7 days.
TRAFFIC = StreamSpec("TRAFFIC", (subjects.TRAFFIC_ALL,), 7 * DAY, 1 * GiB, 1 * MiB,
                     description="ingress -> trace record, live Belady, cost report: one record per finished request")
ALL_STREAMS: tuple[StreamSpec, ...] = (JOBS, HANDOFF, KV_EVENTS, COMMANDS, DEAD_LETTER, SESSIONS, TRAFFIC)
# Streams earlier versions declared and this one deletes. TOKENS stored every token event (a disk write and
# fsync each) that no one read back: the ingress takes them on core NATS, and a lost one is a seq gap it
# recovers from by migration (shared/ingress/supervision/request_run.py).
RETIRED_STREAMS: tuple[str, ...] = ("TOKENS",)

WORKERS = BucketSpec(subjects.WORKERS_BUCKET, max_bytes=64 * MiB, max_value_size=64 * 1024,
                     description="worker heartbeats, one key per worker id, expiring by TTL")
NAMED_CACHES = BucketSpec(subjects.NAMED_CACHES_BUCKET, max_bytes=1 * GiB, max_value_size=4 * MiB,
                          description="named caches (POST /v1/caches): tenant, content, expiry; TTL per entry")
RESPONSE_RETENTION_MAX_S = 30 * DAY  # as OpenAI keeps stored responses; each entry's TTL is ingress.response_retention_s
RESPONSES = BucketSpec(subjects.RESPONSES_BUCKET, max_bytes=4 * GiB, max_value_size=8 * MiB,
                       max_age_s=RESPONSE_RETENTION_MAX_S,
                       description="stored responses (/v1/responses): the response and its conversation; TTL per entry")
ALL_BUCKETS: tuple[BucketSpec, ...] = (WORKERS, NAMED_CACHES, RESPONSES)

# Shared durable consumers: the role queues any free worker takes from, and the index's event feed.
PREFILL_ANY = ConsumerSpec(JOBS.name, "prefill-any", subjects.jobs_prefill())
DECODE_ANY = ConsumerSpec(JOBS.name, "decode-any", subjects.jobs_decode())
HANDOFF_ANY = ConsumerSpec(HANDOFF.name, "handoff-any", subjects.handoff())
CACHE_INDEX = ConsumerSpec(KV_EVENTS.name, "cache-index", subjects.KV_EVENTS_ALL, max_deliver=10)
ALL_CONSUMERS: tuple[ConsumerSpec, ...] = (PREFILL_ANY, DECODE_ANY, HANDOFF_ANY, CACHE_INDEX)


def worker_consumer(stream: StreamSpec, role: str, worker_id: str, filter_subject: str) -> ConsumerSpec:
    """The durable consumer of one worker on its own subject (e.g. jobs addressed to it); see `per_worker`."""
    if not stream.work_queue:
        raise ValueError(f"per-worker consumers expire and are deleted: {stream.name} must be a work queue")
    return ConsumerSpec(stream.name, f"{subjects.token(role)}-{subjects.token(worker_id)}", filter_subject,
                        per_worker=True)


class StreamConfigConflict(RuntimeError):
    """A stream exists with a config that cannot be updated in place to this release's (its data is kept)."""


async def declare_stream(js: JetStreamContext, config: api.StreamConfig) -> api.StreamInfo:
    """Create the stream, or update it in place when it exists with another config.

    Raises StreamConfigConflict when the server refuses the update (a field it cannot change in place,
    such as storage or retention): nothing is deleted, the message says what to do.
    """
    try:
        return await js.add_stream(config)
    except BadRequestError as exc:
        if exc.err_code != _STREAM_NAME_IN_USE:
            raise
    try:
        return await js.update_stream(config)
    except APIError as exc:
        if not isinstance(exc, BadRequestError) and exc.err_code != _STREAM_UPDATE_REFUSED:
            raise
        raise StreamConfigConflict(
            f"stream {config.name} exists with a config this release cannot update in place "
            f"({exc.description}); its messages are kept. Either delete that stream with an admin NATS "
            f"client (its messages are lost; `kvmesh up` then declares it anew) or start with "
            f"`kvmesh up --fresh` (wipes every stream and the S3 data)") from None


async def declare_consumer(js: JetStreamContext, spec: ConsumerSpec,
                           inactive_threshold_s: float | None = None) -> api.ConsumerInfo:
    """Create or update a durable consumer (the server's CONSUMER.CREATE does both since 2.10)."""
    return await js.add_consumer(spec.stream, spec.config(inactive_threshold_s))


async def retire_stream(js: JetStreamContext, name: str) -> bool:
    """Delete stream `name` if it exists; True if it did."""
    try:
        return await js.delete_stream(name)
    except NotFoundError:
        return False


async def declare_all(js: JetStreamContext, replicas: int = 1) -> None:
    """Create or update all streams, shared consumers and KV buckets, delete retired streams; idempotent."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    for name in RETIRED_STREAMS:
        await retire_stream(js, name)
    for stream in ALL_STREAMS:
        await declare_stream(js, stream.config(replicas))
    for bucket in ALL_BUCKETS:
        await declare_stream(js, bucket.config(replicas))
    for consumer in ALL_CONSUMERS:
        await declare_consumer(js, consumer)

