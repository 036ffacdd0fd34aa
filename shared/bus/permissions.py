"""Who may publish and subscribe to what on the bus: one allow-list per role, built from the subject layout.

Every kvmesh process connects as a user of one role (`ROLES`); the server
enforces that user's `Permissions` (nats-server `permissions {publish,
subscribe, allow_responses}`). The table follows shared/protocol/subjects.py
and streams.py; the properties the tests hold it to:

- only the ingress publishes jobs (`kvmesh.jobs.>`) and aborts, and served-traffic records
  (`kvmesh.traffic.<own id>`), which the eviction service (live Belady) and admin read;
- a worker publishes KV events, load reports and its heartbeat
  (`$KV.workers.<id>`) only under its own id, and takes only its own
  addressed jobs, handoffs and commands; it deletes its own consumers of
  them when it drains (per-id users only: a per-role user's `*` would also
  name the shared `any` queues, so its consumers are left to the inactive
  threshold);
- only workers (prefill, decode) make peer-fetch requests, and only a worker
  serves (subscribes to) its own peer-fetch subject;
- a vLLM instance with kvmesh's connector (`vllm`) publishes its own KV
  events and heartbeat and answers the index's dumps of them, and nothing
  else: it takes no jobs, handoffs or commands and serves no peer fetch;
- only prefill sends pulls (`kvmesh.pull.<decode id>`: fetch a prompt it is
  streaming), and a decode worker reads only its own;
- each process receives replies on its own inbox prefix
  `_INBOX.<role>.<id>` (`inbox_prefix`), so nobody reads another's replies
  (peer-fetch replies carry KV bytes);
- JetStream API access names the stream (and, for durables, the consumer and
  its filter subject); `admin` (stream declaration, CLI, benches) may do all.

`worker_id=None` builds the per-role user used where ids are not known in
advance (a Kubernetes Deployment): every own-id rule then reads `*`, any id
of that role. nats-server config-file users have no subject templates
(those are JWT-only), so only per-id users (or JWT / auth callout) make the
own-id rules hold between replicas of one role; see docs/deploy.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.protocol import streams, subjects

INGRESS, PREFILL, DECODE, CACHE_INDEX, EVICTION, VLLM, ADMIN = (
    "ingress", "prefill", "decode", "cache-index", "eviction", "vllm", "admin")
ROLES: tuple[str, ...] = (INGRESS, PREFILL, DECODE, CACHE_INDEX, EVICTION, VLLM, ADMIN)
WORKER_ROLES: tuple[str, ...] = (PREFILL, DECODE)

ANY_ID = "*"  # the own-id token of a per-role user
API = "$JS.API"
REPLIES_MAX = 1  # allow_responses: one reply per request received (request/reply endpoints answer once)


@dataclass(frozen=True, slots=True)
class Permissions:
    """A user's allow-lists; anything not listed is refused. `responses`: replies allowed per request (0: none)."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    responses: int = 0


@dataclass(slots=True)
class _Grants:
    pub: list[str]
    sub: list[str]

    def add(self, pub: tuple[str, ...] | list[str] = (), sub: tuple[str, ...] | list[str] = ()) -> None:
        self.pub += [s for s in pub if s not in self.pub]
        self.sub += [s for s in sub if s not in self.sub]


def inbox_prefix(role: str, worker_id: str) -> str:
    """The reply-inbox prefix of a process: its user may subscribe under it and nowhere else in `_INBOX`."""
    return f"_INBOX.{subjects.token(role)}.{subjects.token(worker_id)}"


def _own(worker_id: str | None) -> str:
    return ANY_ID if worker_id is None else subjects.token(worker_id)


def _durable(role_prefix: str, own: str) -> str:
    """A per-worker consumer's name (`prefill-<id>`); any name for a per-role user (wildcards are whole tokens)."""
    return ANY_ID if own == ANY_ID else f"{role_prefix}-{own}"


def _inbox(role: str, own: str) -> tuple[str, ...]:
    return (f"_INBOX.{role}.{own}.>",)


def _pull(stream: str, durable: str, filter_subject: str) -> tuple[str, ...]:
    """Create-or-update, fetch from and ack a durable pull consumer (CREATE names the filter; the server checks it)."""
    return (f"{API}.CONSUMER.CREATE.{stream}.{durable}.{filter_subject}", f"{API}.CONSUMER.INFO.{stream}.{durable}",
            f"{API}.CONSUMER.MSG.NEXT.{stream}.{durable}", f"$JS.ACK.{stream}.{durable}.>")


def _own_pull(stream: str, role_prefix: str, own: str, filter_subject: str) -> tuple[str, ...]:
    """A worker's own durable consumer: `_pull`, plus deleting it at drain when the user is one id's."""
    durable = _durable(role_prefix, own)
    delete = () if own == ANY_ID else (f"{API}.CONSUMER.DELETE.{stream}.{durable}",)
    return (*_pull(stream, durable, filter_subject), *delete)


def _follow(stream: str) -> tuple[str, ...]:
    """An ordered push consumer on `stream` (nats-py recreates it after a gap; flow control answers on $JS.FC)."""
    return (f"{API}.STREAM.INFO.{stream}", f"{API}.CONSUMER.CREATE.{stream}", f"{API}.CONSUMER.CREATE.{stream}.>",
            f"{API}.CONSUMER.DELETE.{stream}.*", f"{API}.CONSUMER.INFO.{stream}.*", f"$JS.FC.{stream}.>")


def _read_bucket(bucket: streams.BucketSpec) -> tuple[str, ...]:
    """Open, get and watch a KV bucket."""
    s = bucket.stream_name
    return (*_follow(s), f"{API}.DIRECT.GET.{s}", f"{API}.DIRECT.GET.{s}.>", f"{API}.STREAM.MSG.GET.{s}")


def _worker(g: _Grants, role: str, own: str) -> None:
    """What prefill and decode share: own-id events, heartbeat, commands, aborts, dumps, peer fetch."""
    g.add(pub=(subjects.kv_events(own) if own != ANY_ID else f"{subjects.ROOT}.kv.events.*",
               f"{subjects.ROOT}.load.{own}",
               f"{subjects.ROOT}.tokens.*",  # the first token (prefill) and the rest (decode)
               f"{subjects.ROOT}.dlq.{streams.JOBS.name}", f"{subjects.ROOT}.dlq.{streams.COMMANDS.name}",
               f"{subjects.ROOT}.peer.*.fetch", f"{subjects.ROOT}.peer.*.credit",  # peer fetch: workers only
               subjects.INDEX_LOOKUP,  # where a missing prefix block lives
               # replies sent to other processes' inboxes: peer-fetch data (to workers; it goes out on a second
               # connection, so allow_responses, which is per connection, cannot cover it) and state dumps
               *(f"_INBOX.{r}.>" for r in (*WORKER_ROLES, CACHE_INDEX)),
               *_own_pull(streams.COMMANDS.name, "cmd", own, f"{subjects.ROOT}.cmd.{own}"),
               *_follow(streams.SESSIONS.name)),
          sub=(f"{subjects.ROOT}.abort.{own}", f"{subjects.ROOT}.kv.dump.{own}",
               f"{subjects.ROOT}.peer.{own}.fetch", f"{subjects.ROOT}.peer.{own}.credit"))
    if role == PREFILL:
        g.add(pub=(f"{subjects.ROOT}.handoff.*", f"{subjects.ROOT}.pull.*",
                   *_own_pull(streams.JOBS.name, "prefill", own, f"{subjects.ROOT}.jobs.prefill.{own}"),
                   *_pull(streams.JOBS.name, streams.PREFILL_ANY.durable, streams.PREFILL_ANY.filter_subject)))
    else:
        g.add(sub=(f"{subjects.ROOT}.pull.{own}",))
        g.add(pub=(f"{subjects.ROOT}.dlq.{streams.HANDOFF.name}",
                   *_own_pull(streams.JOBS.name, "decode", own, f"{subjects.ROOT}.jobs.decode.{own}"),
                   *_pull(streams.JOBS.name, streams.DECODE_ANY.durable, streams.DECODE_ANY.filter_subject),
                   *_own_pull(streams.HANDOFF.name, "handoff", own, f"{subjects.ROOT}.handoff.{own}"),
                   *_pull(streams.HANDOFF.name, streams.HANDOFF_ANY.durable, streams.HANDOFF_ANY.filter_subject)))


def permissions(role: str, worker_id: str | None = None) -> Permissions:
    """The allow-lists of `role`'s user for process `worker_id` (None: any process of that role)."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; one of {', '.join(ROLES)}")
    if role == ADMIN:
        return Permissions(publish=(">",), subscribe=(">",))
    own = _own(worker_id)
    g = _Grants(pub=[], sub=list(_inbox(role, own)))
    # every service heartbeats under its own id and follows the others' heartbeats
    g.add(pub=(f"$KV.{subjects.WORKERS_BUCKET}.{own}", *_read_bucket(streams.WORKERS)))
    if role in WORKER_ROLES:
        _worker(g, role, own)
    elif role == INGRESS:
        g.add(pub=(subjects.JOBS_ALL, subjects.ABORT_ALL, subjects.SESSION_EVENTS, f"{subjects.ROOT}.traffic.{own}",
                   subjects.INDEX_LOOKUP, subjects.EVICTION_PIN,
                   f"$KV.{subjects.NAMED_CACHES_BUCKET}.>", f"$KV.{subjects.RESPONSES_BUCKET}.>",
                   *_read_bucket(streams.NAMED_CACHES), *_read_bucket(streams.RESPONSES)),
              sub=(subjects.TOKENS_ALL,))  # token events: core NATS, no stream
    elif role == CACHE_INDEX:
        obj = f"OBJ_{subjects.INDEX_SNAPSHOT_BUCKET}"
        g.add(pub=(f"{subjects.ROOT}.kv.dump.*", *_follow(streams.KV_EVENTS.name),
                   f"{API}.STREAM.CREATE.{obj}", f"{API}.STREAM.PURGE.{obj}", f"{API}.STREAM.MSG.GET.{obj}",
                   f"{API}.DIRECT.GET.{obj}", f"{API}.DIRECT.GET.{obj}.>", *_follow(obj),
                   f"$O.{subjects.INDEX_SNAPSHOT_BUCKET}.>"),
              sub=(subjects.INDEX_LOOKUP, subjects.INDEX_SNAPSHOT))
    elif role == VLLM:  # shared/connectors/vllm/fleet.py: its KV events, answering the index's dumps of them
        g.add(pub=(subjects.kv_events(own) if own != ANY_ID else f"{subjects.ROOT}.kv.events.*",
                   f"_INBOX.{CACHE_INDEX}.>"),
              sub=(f"{subjects.ROOT}.kv.dump.{own}",))
    elif role == EVICTION:
        # it also publishes KV events under its own id (L3 deletions) and answers the index's dumps of them
        g.add(pub=(subjects.COMMANDS_ALL, *_follow(streams.KV_EVENTS.name), *_follow(streams.SESSIONS.name),
                   *_follow(streams.TRAFFIC.name),  # live Belady reads the served traffic
                   f"{subjects.ROOT}.kv.events.{own}", f"_INBOX.{CACHE_INDEX}.>"),
              sub=(subjects.EVICTION_PIN, f"{subjects.ROOT}.kv.dump.{own}"))
    responses = REPLIES_MAX if role in (CACHE_INDEX, EVICTION) else 0
    return Permissions(publish=tuple(g.pub), subscribe=tuple(g.sub), responses=responses)


def table(worker_ids: dict[str, list[str]] | None = None) -> dict[str, Permissions]:
    """User name -> permissions: one per-role user per role, plus one per known worker id (`{role: [ids]}`)."""
    users = {role: permissions(role) for role in ROLES}
    for role, ids in (worker_ids or {}).items():
        for wid in ids:
            users[wid] = permissions(role, wid)
    return users
