"""Every NATS subject kvmesh uses, in one place; services never spell a subject themselves.

Layout (`<x>` is one token: no dots, spaces or wildcards):

    kvmesh.jobs.prefill.<worker>|any    ingress -> prefill        (stream JOBS, work queue)
    kvmesh.jobs.decode.<worker>|any     ingress -> decode         (stream JOBS, work queue)
    kvmesh.handoff.<decode worker>      prefill -> decode: KV block handles + first token (stream HANDOFF)
    kvmesh.tokens.<request>             decode -> ingress: streamed tokens (core NATS, no stream)
    kvmesh.abort.<worker>               ingress -> prefill/decode: stop a request (core NATS, AbortRequest)
    kvmesh.kv.events.<worker>           any worker -> cache-index: BlockStored/BlockRemoved/... (stream KV_EVENTS)
    kvmesh.kv.dump.<worker>             cache-index -> a worker: send your whole L1/L2 state (request, chunked reply)
    kvmesh.cmd.<worker>                 eviction / ops -> a worker: demote, delete, drain (stream COMMANDS)
    kvmesh.load.<worker>                worker load reports for eviction and routing (core NATS)
    kvmesh.index.lookup                 ingress -> cache-index: longest-prefix query (request/reply)
    kvmesh.index.snapshot               ops -> cache-index: write a snapshot now (request/reply)
    kvmesh.eviction.pin                 ingress -> eviction: pin a named cache / breakpoint (request/reply)
    kvmesh.dlq.<stream>                 dead letters of a stream (stream DEAD_LETTER)
    kvmesh.traffic.<ingress>            ingress -> readers: one TrafficRecord per finished request (stream TRAFFIC)
    $KV.workers.<worker>                heartbeats (KV bucket `workers`)
    $KV.responses.<tenant>.<response>   stored responses of /v1/responses (KV bucket `responses`)
"""

from __future__ import annotations

import re

ROOT = "kvmesh"
ANY = "any"  # the shared queue of a role, taken by whichever worker is free

_TOKEN = re.compile(r"^[A-Za-z0-9_\-]+$")


def token(value: str) -> str:
    """`value` checked to be a single subject token (ids become subject parts; a '.' or '*' would re-route)."""
    if not _TOKEN.match(value):
        raise ValueError(f"not a valid subject token: {value!r} (letters, digits, '-' and '_' only)")
    return value


def family(subject: str) -> str:
    """The first two tokens (`kvmesh.jobs`, `$KV.workers`): a bounded metrics label for any subject."""
    return ".".join(subject.split(".")[:2])


# Jobs: ingress hands work to a role, either a chosen worker or the role's shared queue.
JOBS_ALL = f"{ROOT}.jobs.>"


def jobs_prefill(worker_id: str = ANY) -> str:
    return f"{ROOT}.jobs.prefill.{token(worker_id)}"


def jobs_decode(worker_id: str = ANY) -> str:
    return f"{ROOT}.jobs.decode.{token(worker_id)}"


# Prefill -> decode handoff of KV block handles.
HANDOFF_ALL = f"{ROOT}.handoff.>"


def handoff(decode_worker_id: str = ANY) -> str:
    return f"{ROOT}.handoff.{token(decode_worker_id)}"


# Tokens streamed back to the ingress that owns the request.
TOKENS_ALL = f"{ROOT}.tokens.>"


def tokens(request_id: str) -> str:
    return f"{ROOT}.tokens.{token(request_id)}"


# Aborts: ingress -> the worker running a request (client gone). Core NATS: an abort is best effort,
# a lost one only means the worker finishes a request nobody reads (bounded by max_tokens and deadline).
ABORT_ALL = f"{ROOT}.abort.>"


def abort(worker_id: str) -> str:
    return f"{ROOT}.abort.{token(worker_id)}"


# Pulls: prefill -> the decode worker it hands a long prompt to, while prefilling it: "bring this chain
# from my L2 into your pool" (shared/serving/prefill_stream.py). Core NATS: advice; a lost one only means
# the DecodeJob fetches those blocks itself.
def pull(worker_id: str) -> str:
    return f"{ROOT}.pull.{token(worker_id)}"


# KV cache events (stored / removed / cleared) feeding the cache index.
KV_EVENTS_ALL = f"{ROOT}.kv.events.>"


def kv_events(worker_id: str) -> str:
    return f"{ROOT}.kv.events.{token(worker_id)}"


# State dumps: the cache index asks one worker for its whole L1/L2 state after a sequence gap
# (core NATS; the reply is several chunk messages to the request's inbox).
def kv_dump(worker_id: str) -> str:
    return f"{ROOT}.kv.dump.{token(worker_id)}"


# Commands to one worker (demote, delete, drain).
COMMANDS_ALL = f"{ROOT}.cmd.>"


def commands(worker_id: str) -> str:
    return f"{ROOT}.cmd.{token(worker_id)}"


# Session events: the ingress says how each agent turn ended (shared/sessions/events.py); eviction listens.
SESSION_EVENTS = f"{ROOT}.sessions.events"


# Served traffic: one TrafficRecord per finished request (shared/protocol/traffic.py), per ingress replica.
TRAFFIC_ALL = f"{ROOT}.traffic.>"


def traffic(ingress_id: str) -> str:
    return f"{ROOT}.traffic.{token(ingress_id)}"


# Load reports: fire-and-forget, core NATS (a lost report is replaced by the next).
LOAD_ALL = f"{ROOT}.load.>"


def load(worker_id: str) -> str:
    return f"{ROOT}.load.{token(worker_id)}"


# Request/reply endpoints (core NATS, queue groups).
INDEX_LOOKUP = f"{ROOT}.index.lookup"
INDEX_SNAPSHOT = f"{ROOT}.index.snapshot"
INDEX_SNAPSHOT_BUCKET = "cache_index"  # JetStream object store holding the index snapshot
EVICTION_PIN = f"{ROOT}.eviction.pin"

# Dead letters: a poison message of stream S is copied to dead_letter(S).
DEAD_LETTER_ALL = f"{ROOT}.dlq.>"


def dead_letter(stream: str) -> str:
    return f"{ROOT}.dlq.{token(stream)}"


# Heartbeats live in a JetStream KV bucket; the key is the worker id.
WORKERS_BUCKET = "workers"


def heartbeat_key(worker_id: str) -> str:
    """The raw subject of a worker's heartbeat in the `workers` bucket (for a publish with a TTL)."""
    return f"$KV.{WORKERS_BUCKET}.{token(worker_id)}"


# Named caches (POST /v1/caches): metadata in a JetStream KV bucket, key = cache id, TTL per entry.
NAMED_CACHES_BUCKET = "named_caches"

# Stored responses (POST /v1/responses, `store`): KV bucket `responses`, key = <tenant scope>.<response id>.
RESPONSES_BUCKET = "responses"


def response_key(tenant_scope: str, response_id: str) -> str:
    """The key of a stored response in the `responses` bucket (two tokens: a tenant's keys share a prefix)."""
    return f"{token(tenant_scope)}.{token(response_id)}"


# Headers kvmesh sets (NATS ones are spelled by nats-py's api.Header).
HDR_MSG_ID = "Nats-Msg-Id"
HDR_DLQ_REASON = "Kvmesh-Dlq-Reason"
HDR_DLQ_DELIVERIES = "Kvmesh-Dlq-Deliveries"
HDR_DLQ_SUBJECT = "Kvmesh-Dlq-Subject"
HDR_DLQ_STREAM = "Kvmesh-Dlq-Stream"
HDR_DLQ_STREAM_SEQ = "Kvmesh-Dlq-Stream-Seq"
HDR_DLQ_CONSUMER = "Kvmesh-Dlq-Consumer"
HDR_REPLY_STATUS = "Kvmesh-Reply-Status"  # "error" when the body is an ErrorReply
HDR_REQUEST_ID = "Kvmesh-Request-Id"  # carried across hops so every service logs the same request_id
HDR_SESSION_ID = "Kvmesh-Session-Id"
