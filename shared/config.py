"""Every kvmesh setting, in one place.

Settings come from the environment with the prefix ``KVMESH_``; nested
sections use ``__`` (``KVMESH_ENGINE__BLOCK_SIZE=32``). A few top-level
names that operators reach for first (``KVMESH_NATS_URL``,
``KVMESH_S3_ENDPOINT`` ...) are plain fields so they read naturally.
Services build one ``Settings`` at start and pass sections down; nothing
reads the environment anywhere else.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class NatsSettings(BaseModel):
    """The local nats-server that `kvmesh up` starts (ignored when nats_url is set)."""

    host: str = "127.0.0.1"
    port: int = 4222
    monitor_port: int = 8222
    cluster_nodes: int = 1  # 1, or an odd number >= 3: a routed cluster on loopback (node 0 on port/monitor_port)
    replicas: int = 1  # stream replicas; a local cluster declares at least 3
    max_payload: int = 8 * 1024 * 1024
    auth: bool = True  # users with per-role permissions (shared/bus/permissions.py), passwords in the state dir
    tls_cert: Path | None = None  # server certificate and key: clients then connect with TLS
    tls_key: Path | None = None
    tls_ca: Path | None = None  # the CA that signed tls_cert: services verify the server with it


class S3Settings(BaseModel):
    """The local S3 server that `kvmesh up` starts (ignored when s3_endpoint is set)."""

    host: str = "127.0.0.1"
    port: int = 8333
    master_port: int = 9333
    volume_port: int = 8080
    filer_port: int = 8888
    bucket: str = "kvmesh-kv"
    region: str = "us-east-1"


class ConstraintSettings(BaseModel):
    """How far a constrained request's random walk may grow where its schema sets no bound (shared/constrain/bounds.py)."""

    max_string_length: int = Field(default=64, ge=1)  # chars, strings without maxLength/enum/const/pattern/format
    max_array_items: int = Field(default=8, ge=1)  # arrays without maxItems
    max_properties: int = Field(default=8, ge=1)  # free-form objects (no `properties`)
    max_integer_digits: int = Field(default=9, ge=1)  # |n| < 10**digits for numbers without minimum/maximum
    number_fraction_digits: int = Field(default=4, ge=0)  # numbers without multipleOf: at most this many decimals
    max_parallel_calls: int = Field(default=4, ge=1)  # tool calls in one parallel answer
    grammar_cache_size: int = Field(default=256, ge=1)  # compiled grammars kept per worker (LRU by constraint)
    # Fill a step's token masks on a thread while the model's forward runs. None: only when the forward runs on an
    # accelerator (the CPU is idle meanwhile); on a CPU the forward already uses every core and the thread competes.
    overlap_masks: bool | None = None


class EngineSettings(BaseModel):
    # What computes a worker's tokens: vLLM in process with kvmesh's connector as its KV layer
    # (shared/workers/vllm_backend.py), or kvmesh's own paged-KV engine (native; shared/serving).
    # auto: vLLM where it imports, else native (`kvmesh up` says so in one line).
    backend: Literal["auto", "vllm", "native"] = "auto"
    block_size: int = 16
    num_blocks: int = 2048
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # per-step token budget (chunked prefill)
    dtype: str = "float32"
    device: str = "cpu"
    # a name in shared/cache_policy/registry.py; "default" ranks by the session's predicted return, fed
    # with the sessions' turn events (shared/serving/session_feed.py)
    eviction_policy: str = "default"
    threads: int = Field(default=0, ge=0)  # torch intra-op threads of a worker's engine; 0: torch's default (cores)
    enable_prefix_caching: bool = True  # False: never reuse cached blocks (the cache-off baseline)
    pin_fraction: float = Field(default=0.5, ge=0.0, le=1.0)  # of the pool TTL pins may hold (breakpoints, sessions)
    pin_tenant_fraction: float = Field(default=0.25, ge=0.0, le=1.0)  # of the pool one tenant's pins may hold
    constraints: ConstraintSettings = Field(default_factory=ConstraintSettings)

    def resolved_backend(self) -> Literal["vllm", "native"]:
        """The backend `auto` stands for here: vllm where this Python finds vLLM, else native."""
        if self.backend != "auto":
            return self.backend
        return "vllm" if importlib.util.find_spec("vllm") is not None else "native"


class TierSettings(BaseModel):
    l2_capacity_bytes: int = 2 * 1024**3
    l3_enabled: bool = True
    l3_chunk_tokens: int = 256
    l3_upload_queue_bytes: int = 256 * 1024**2  # bytes the upload queue owns (blocks L2 could not take) + bookkeeping
    l3_tail_delay_s: float = 5.0  # a chain's partial last chunk is written once the chain is left alone this long
    # How long an L3 upload of vLLM's connector waits for a gap in vLLM's steps. Uploads run Python in vLLM's
    # worker process, and while they do they hold the GIL from the forward pass (measured: +23% TTFT on 8
    # agent sessions here; docs/vllm-connector.md). So they go when vLLM idles, at most this late.
    connector_upload_max_defer_s: float = Field(default=600.0, ge=0.0)
    l3_known_chunks: int = 65_536  # chunk keys a worker remembers as stored in L3 (~230 B each: ~15 MiB)
    l3_known_max_age_s: float = 600.0  # ... trusted this long (the GC may delete objects unseen by the worker)
    # A name in shared/cache_policy/registry.py. LRU, not "default": no session events reach the tier, and
    # what it holds arrives in L1's order (demoted by the default policy) and leaves on the eviction
    # service's advice, which the default policy ranks with the sessions (docs/eviction-policy.md).
    l2_eviction_policy: str = "lru"
    l2_shared_memory: bool = True  # L2 blocks in POSIX shm segments: same-host peers map them
    # the first bytes of a shared-memory L2 are faulted in at start, in the background (the first blocks
    # stored, a handoff's, then pay no page faults); they stay committed in /dev/shm
    l2_prefault_bytes: int = Field(default=512 * 1024**2, ge=0)
    l3_ttl_s: int = 7 * 24 * 3600  # written to object metadata for the eviction service
    l3_breaker_failures: int = 3  # consecutive S3 failures that open the circuit
    l3_breaker_reset_s: float = 2.0  # open -> half-open probe after this long
    peer_timeout_s: float = 2.0


class ServiceSettings(BaseModel):
    """What every service process shares: identity, HTTP side port, heartbeat."""

    worker_id: str = ""
    http_host: str = "127.0.0.1"
    http_port: int = 0  # 0 = pick a free port
    heartbeat_interval_s: float = 1.0  # how often a heartbeat's state is looked at; a change is written then
    heartbeat_ttl_s: float = 5.0  # the entry lives this long after a write; unchanged, it is rewritten every ttl/3
    drain_timeout_s: float = 10.0


class BusSettings(BaseModel):
    """How services talk over NATS: reconnects, publish retries, consumer defaults."""

    connect_timeout_s: float = 5.0
    connect_retry_total_s: float = 30.0  # first connect: keep trying this long (NATS may still be starting)
    reconnect_wait_min_s: float = 0.1  # exponential backoff between reconnect attempts
    reconnect_wait_max_s: float = 2.0
    publish_timeout_s: float = 2.0  # one JetStream publish attempt
    publish_retry_total_s: float = 20.0  # rides out a leader election, then the error propagates
    publish_retry_min_s: float = 0.05
    publish_retry_max_s: float = 2.0
    request_timeout_s: float = 5.0
    nak_delay_s: float = 1.0
    fetch_batch: int = 16
    fetch_timeout_s: float = 1.0  # how long an idle pull waits on a shared queue (prefill-any, the index feed...)
    # ... and on a per-worker consumer. There is one per worker and role, so this sets the fleet's idle pull
    # rate (each idle poll is two pull requests and two status replies for nats-server); it is also how long
    # a pull the server lost (NATS restarted) can hold up that worker's own messages. Stops do not wait for it.
    worker_fetch_timeout_s: float = Field(default=5.0, gt=0.0)
    # A per-worker durable consumer (jobs/handoffs/commands addressed to one worker id) nobody fetched from
    # for this long is deleted by the server: outlasts a restart of the same id and a leader election, while
    # ids that churn away leave nothing behind (a busy worker keeps it: pending acks count as activity).
    worker_consumer_inactive_s: float = Field(default=300.0, gt=0.0)


class WorkerSettings(BaseModel):
    """The prefill and decode workers (shared/serving)."""

    probe_peers: bool = True  # prefill looks for missing prefix blocks in same-host peers' shared-memory L2
    l3_wait_s: float = 30.0  # a named cache (prefill_only) waits this long for its L3 write
    remember_finished: int = 4096  # (request, attempt) pairs kept to ack redeliveries without re-running
    resolve_inflight: int = Field(default=3, ge=1)  # KV windows (an L3 chunk / a peer batch) fetched at once per request
    # prefill restores from a tier only while that beats recomputing here (shared/serving/restore_gate.py);
    # False: every tier is asked whatever it costs (tests and benchmarks of the restore paths themselves)
    restore_gate: bool = True
    # A prompt handed off to a decode worker goes to L2 step by step while it is prefilled, and the decode
    # worker pulls it as it comes (shared/serving/prefill_stream.py); it holds what it pulled this long.
    stream_handoff: bool = True
    stream_hold_s: float = Field(default=30.0, gt=0.0)


class SessionRetentionSettings(BaseModel):
    """How the eviction service keeps agent sessions by their predicted return (shared/eviction/sessions.py)."""

    # On: pins and prefetch for sessions expected back soon, from every SessionEvent; its pins are bounded
    # by `pin_fraction` of a worker's L1 (docs/eviction-policy.md).
    enabled: bool = True
    pin_horizon_s: float = Field(default=120.0, ge=0.0)  # sessions expected back within this are pinned in L1
    pin_margin_s: float = Field(default=10.0, ge=0.0)  # a pin outlives the predicted return by this much
    pin_fraction: float = Field(default=0.4, ge=0.0, le=1.0)  # of a worker's L1 that session pins may ask for
    prefetch_lead_s: float = Field(default=5.0, ge=0.0)  # a later session is fetched back this long before
    min_p_return: float = Field(default=0.3, ge=0.0, le=1.0)  # ... if at least this likely to come back at all
    max_sessions: int = Field(default=16_384, ge=1)  # tracked sessions; the least recently active go first
    # A session whose turn was admitted is pinned this long (its end event re-plans); 0: only ranked as in use.
    # Off: pins for every queued turn take room its prefill needs, and no run showed them helping (agent-sessions.md)
    in_use_hold_s: float = Field(default=0.0, ge=0.0)


class LiveBeladySettings(BaseModel):
    """Live Belady in the eviction service (shared/eviction/live_belady.py, docs/operator-view.md)."""

    enabled: bool = True
    window_accesses: int = Field(default=262_144, ge=1)  # block accesses kept: ~8 bytes each (plus per request)
    window_s: float = Field(default=3600.0, gt=0.0)  # and none older than this
    period_s: float = Field(default=120.0, gt=0.0)  # seconds between recomputes, at least
    max_cpu_share: float = Field(default=0.02, gt=0.0, le=1.0)  # recompute's share of one core; stretches the period
    # What-if: the bound at this fleet L1 (blocks) instead of the live prefill workers' pools from their heartbeats
    capacity_blocks: int | None = Field(default=None, ge=1)


class EvictionSettings(BaseModel):
    """The global eviction service (shared/eviction): watermarks, L3 GC budgets, warm-up."""

    policy: str = "default"  # a name in shared/cache_policy/registry.py: the order of all its advice
    tick_s: float = 1.0  # how often occupancy is checked against the watermarks
    high_water: float = 0.9  # share of a tier's capacity above which it advises demotion
    low_water: float = 0.75  # ... down to this share
    l1_capacity_blocks: int | None = None  # None: engine.num_blocks
    l2_capacity_blocks: int | None = None  # None: no L2 advice (L2 evicts by itself when full)
    readvise_s: float = 30.0  # a block advised to leave is not advised again for this long
    max_hashes_per_command: int = 4096
    gc_interval_s: float = 60.0
    gc_keys_per_pass: int | None = Field(default=100_000, ge=1)  # L3 keys one GC pass lists; None: the whole bucket
    scrub_bytes_per_pass: int = 256 * 1024 * 1024  # L3 bytes a GC pass reads to find damaged objects
    l3_capacity_bytes: int | None = None  # budget of the whole L3 bucket; None: TTL only
    namespace_quota_bytes: int | None = None  # per-tenant L3 budget; None: no quota
    warm_max_chunks: int = 64  # chunk keys in a new worker's warm command
    warm_window_s: float = 120.0  # a worker is warmed if it started this recently (not on a service restart)
    max_block_stats: int = 2_000_000  # access stats kept for blocks held nowhere any more are pruned beyond this
    sessions: SessionRetentionSettings = Field(default_factory=SessionRetentionSettings)
    live_belady: LiveBeladySettings = Field(default_factory=LiveBeladySettings)


class PinQuotaSettings(BaseModel):
    """Caps on pinned bytes (cache_control breakpoints, named caches) in L2 and L3, per pool and per tenant.

    L1's caps are `engine.pin_fraction` / `engine.pin_tenant_fraction`. L2's hold per worker (a pin past them
    pins what fits). L3's are the eviction service's, for the whole deployment: a request past its tenant's
    cap is refused with a 429 (docs/kv-tiers.md, "Pin budgets").
    """

    l2_fraction: float = Field(default=0.5, ge=0.0, le=1.0)  # of a worker's L2 bytes that pins may hold
    l2_tenant_fraction: float = Field(default=0.25, ge=0.0, le=1.0)  # ... that one tenant's pins may hold
    l3_fraction: float = Field(default=0.5, ge=0.0, le=1.0)  # of eviction.l3_capacity_bytes that pins may hold
    l3_pool_bytes: int | None = Field(default=None, ge=0)  # the L3 pool cap where l3_capacity_bytes is unset; None: none
    # a tenant's pins (named caches included) count against its L3 quota: this share of
    # eviction.namespace_quota_bytes, or l3_tenant_bytes where no quota is set
    l3_tenant_fraction: float = Field(default=1.0, ge=0.0, le=1.0)
    l3_tenant_bytes: int = Field(default=64 * 1024**3, ge=0)
    block_bytes: int | None = Field(default=None, ge=1)  # KV bytes of one block, for pins that do not say; None: model


class StackSettings(BaseModel):
    """How `kvmesh up` runs the local stack (servers from wheels, services from a package)."""

    bin_dir: Path | None = None  # look for nats-server / weed only here (default: beside python, then PATH)
    services_package: str = "kvmesh.services"  # every <package>.<name> with a __main__ is a service
    ready_timeout_s: float = 900.0  # vLLM's first start compiles for minutes; a process that dies fails at once
    stop_grace_s: float = 10.0  # SIGTERM, then SIGKILL after this


class IngressSettings(BaseModel):
    """The HTTP front door: where it listens, its limits, and how it supervises a request's hops."""

    host: str = "127.0.0.1"
    port: int = 8000
    keys_file: Path | None = None  # lines `key:tenant`; default <state_dir>/api_keys when KVMESH_API_KEYS is unset
    # the salt secret as a file (hex; e.g. a mounted Kubernetes Secret), read when KVMESH_INGRESS_SECRET is unset;
    # neither: <state_dir>/ingress_secret (made by `kvmesh up`), else the ingress refuses to start
    secret_file: Path | None = None
    model_id: str = ""  # the id clients name; default: the model dir's name
    max_body_bytes: int = 4 * 1024 * 1024
    rate_limit_per_s: float = 100.0  # per API key, token bucket refill
    rate_limit_burst: float = 200.0
    max_in_flight: int = 256  # requests streaming at once; beyond: overload (503 / 529)
    worker_overload_factor: float = 2.0  # affinity is abandoned once a worker's load exceeds this x capacity
    first_token_timeout_s: float = 60.0  # PrefillJob published -> seq 0 arrives
    inter_token_timeout_s: float = 30.0  # silence between two token events mid-stream
    max_attempts: int = 3  # prefill retries + decode migrations per request
    request_deadline_s: float = 600.0
    assistant_memory: int = 4096  # per tenant: assistant texts whose generated ids are spliced back into prompts
    # cache-aware prefill routing (shared/ingress/routing/cost.py): seconds per block to bring a cached block in
    routing: Literal["cost", "load", "round_robin"] = "cost"  # "cost" (prefix + load), "load" (least loaded), "round_robin" (tests, benchmarks)
    index_timeout_s: float = 0.05  # cache-index lookup; no answer by then -> route by load (counted as degraded)
    prefill_s_per_token: float = 2e-4  # prior prefill rate until a worker's own is measured (EWMA of TTFT/token)
    prefill_rate_alpha: float = 0.2
    queue_s_per_request: float = 0.05  # a request already running on the worker
    fetch_l2_s_per_block: float = 2e-4  # own host memory -> pool
    fetch_peer_s_per_block: float = 2e-3  # another worker's L1/L2 over peer fetch
    fetch_l3_s_per_block: float = 8e-3  # object storage
    affinity_bonus_s: float = 0.02  # the session/prompt_cache_key home's cost is lowered by this (a bonus, no veto)
    load_bound: float = 1.5  # bounded load: no worker above load_bound x the average in-flight (+1) per worker
    # where a request decodes (shared/ingress/routing/placement.py): "split" always hands off to a decode worker;
    # "priced" decodes on the prefill worker unless the handoff pays (`kvmesh up` runs "priced": one box)
    decode_placement: Literal["split", "priced", "local"] = "split"  # ingress/routing/placement.py
    handoff_s_per_block: float = 5e-3  # prior: a block's KV moved from the prefill into the decode worker's pool
    decode_s_per_token: float = 0.02  # prior: one decode step's share of a batch, as a queued prefill feels it
    # the tool-call syntax parsed from (and forced on) outputs: "auto" (from the chat template) or a name in
    # shared/toolcalls/formats.py ("hermes", "llama3_json")
    tool_parser: str = "auto"
    # stored /v1/responses live this long (TTL per entry; the bucket's max age, 30 days, is the ceiling)
    response_retention_s: float = Field(default=30 * 24 * 3600.0, gt=0.0, le=30 * 24 * 3600.0)


class IndexSettings(BaseModel):
    """KV events (worker side) and the cache-index service."""

    flush_interval_s: float = 0.02  # a worker batches its events this long before publishing
    max_batch_hashes: int = 8192  # hashes per published batch (~70 B each: well under KV_EVENTS' 1 MiB)
    max_pending_hashes: int = 1_000_000  # unpublished backlog kept while NATS is down; beyond: dropped (a gap)
    dump_timeout_s: float = 5.0  # the index waits this long for a worker's state dump
    lag_grace_s: float = 3.0  # a feed stuck behind what the worker's heartbeat says is published: a lost event
    snapshot_every_events: int = 200_000  # events applied between two snapshots
    snapshot_every_s: float = 60.0
    snapshot_name: str = "index"  # object name in the snapshot bucket (one per index deployment)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="KVMESH_",
        env_nested_delimiter="__",
        extra="ignore",
    )

    state_dir: Path = Path(".kvmesh")
    model_dir: Path | None = None
    log_level: str = "info"

    # External servers: when set, `kvmesh up` uses them instead of starting local ones.
    nats_url: str | None = None
    nats_user: str | None = None  # this process's NATS user (`kvmesh up` gives each service its own)
    nats_password: str | None = None
    nats_tls_ca: Path | None = None  # client side TLS: the CA that signed the server's certificate
    nats_tls_cert: Path | None = None  # client certificate and key, for servers that verify clients
    nats_tls_key: Path | None = None
    s3_endpoint: str | None = None
    s3_access_key: str | None = None
    s3_secret_key: str | None = None
    s3_secure: bool = False
    audit_rate: float = Field(default=0.0, ge=0.0, le=1.0)  # share of cache-hit requests recomputed cold and compared
    api_keys: str | None = None  # `key:tenant,key:tenant`; unset: the ingress keys file
    ingress_secret: str | None = None  # hex, >= 32 bytes: the deployment's tenant-salt secret (same on every replica)
    kernels: str = "auto"  # auto | torch | triton; kernels/dispatch.py reads KVMESH_KERNELS per call

    nats: NatsSettings = Field(default_factory=NatsSettings)
    s3: S3Settings = Field(default_factory=S3Settings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    tiers: TierSettings = Field(default_factory=TierSettings)
    service: ServiceSettings = Field(default_factory=ServiceSettings)
    stack: StackSettings = Field(default_factory=StackSettings)
    bus: BusSettings = Field(default_factory=BusSettings)
    workers: WorkerSettings = Field(default_factory=WorkerSettings)
    ingress: IngressSettings = Field(default_factory=IngressSettings)
    index: IndexSettings = Field(default_factory=IndexSettings)
    eviction: EvictionSettings = Field(default_factory=EvictionSettings)
    pins: PinQuotaSettings = Field(default_factory=PinQuotaSettings)


def load_settings(**overrides: object) -> Settings:
    """Read the environment once; keyword overrides win (used by the CLI)."""
    return Settings(**overrides)
