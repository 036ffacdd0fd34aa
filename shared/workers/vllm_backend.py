"""kvmesh prefill and decode workers whose engine is vLLM (`engine.backend = "vllm"`): jobs in, tokens out.

`python -m kvmesh.services.prefill` (and `.decode`) with
`KVMESH_ENGINE__BACKEND=vllm` (what `kvmesh up --engine vllm` starts) runs
vLLM in process (`AsyncLLM`, its engine core in a child process as always)
with `KVMeshConnector` loaded under the service's worker id. To the rest of
the fleet it is a kvmesh worker of its role: it heartbeats as one and takes
the same jobs from the same consumers.

A prefill worker runs a `PrefillJob` to its end when the job names it as the
decode worker (the ingress's placement: `local`, or `priced` on one host or
with no decode worker; shared/ingress/routing/placement.py):

- tokens stream from seq 0 through `TokenStream` (the first event carries the
  prompt's cached tokens: vLLM's own prefix cache plus what the connector
  loaded from L2, a peer's L2 or L3);
- each (request, attempt) runs once (`JobLedger`), aborts and migrations
  fence it, the deadline ends it with a retriable error;
- the connector, not this worker, keeps the KV: every full block vLLM
  computes goes to the worker's L2 and S3, and its KV events, published under
  this worker's id, let the cache index and the ingress's router find them.

A job that names another worker is handed off, as kvmesh's own prefill
worker does: vLLM computes the prompt and the first token (seq 0), then a
`DecodeJob` goes to that worker with handles naming the prompt's blocks in
this worker's L2 slab (the connector kept them in the step that computed
them). A vLLM decode worker runs prompt + the delivered tokens with the
handles' owners named in vLLM's `kv_transfer_params`, so its connector loads
the prompt's KV out of their slabs (connectors/vllm/request_peers.py), and
streams on from seq len(generated). A migrated request arrives the same way,
without handles; its connector finds what L3 holds. Slabs are shared memory:
prefill and decode workers on one host (`kvmesh up`), not across hosts. A
seeded request's tokens after the first are sampled by the decode worker's
own generator, and a stop string is matched in the text it generates.

Decoding constrained to a grammar (tool_choice, response_format) runs
kvmesh's own llguidance grammar in vLLM's structured-output backend; such a
request decodes on its prefill worker (the grammar's state lives there), and
one that migrates mid-answer ends with a clear error. Not here (refused with
a clear error, never served wrongly): named caches (`prefill_only`). Pins
are served as ordinary blocks: the connector keeps every block, but nothing
holds one for a TTL. The eviction service's advice
(session retention, prefetch) is taken by the connector, for its L2
(shared/connectors/vllm/advice.py); vLLM's pool is vLLM's.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field

from kvmesh.bus.consumer import PermanentError, typed
from kvmesh.bus.publish import Publisher
from kvmesh.config import ConstraintSettings, WorkerSettings
from kvmesh.constrain.grammar import ConstraintError, lark_source
from kvmesh.connectors.vllm.request_peers import PEERS_PARAM
from kvmesh.engine.model_config import parse_model_config
from kvmesh.log import get_logger
from kvmesh.protocol import subjects
from kvmesh.protocol.blocks import BlockHandle, Tier
from kvmesh.protocol.messages import Role
from kvmesh.protocol.serving import DecodeJob, PrefillJob, SamplingSpec, TokenEvent
from kvmesh.protocol.streams import DECODE_ANY, HANDOFF_ANY, PREFILL_ANY
from kvmesh.protocol.vllm_identity import chain_hashes, model_fingerprint
from kvmesh.service.runner import ServiceContext
from kvmesh.serving.ledger import JobLedger, run_once, stop_here
from kvmesh.serving.pinning import cache_created
from kvmesh.serving.runtime import job_consumer
from kvmesh.serving.services import listen_for_aborts, own_job_consumers
from kvmesh.serving.token_stream import TokenStream, publish_event
from kvmesh.tiers.block_format import CHECKSUM_BYTES
from kvmesh.tiers.shm_slab import SlabReader
from kvmesh.workers.vllm_cores import allowed_cores, bind_env

log = get_logger(__name__)

CONNECTOR = {"kv_connector": "KVMeshConnector", "kv_connector_module_path": "kvmesh.connectors.vllm",
             "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}


@dataclass(slots=True)
class _Run:
    """One vLLM request for a job: its tokens in, its stream out from `first_seq`."""

    request_id: str
    attempt: int
    prompt_ids: list[int]  # what vLLM computes: the prompt, and on a handoff the tokens already delivered
    salt_hex: str
    params: object  # vllm.SamplingParams
    deadline: float
    first_seq: int = 0
    prompt_tokens: int = 0  # the original prompt's length, as the client's usage counts it
    cached_tokens: int | None = None  # reported on the stream; None: what vLLM found (its cache + the connector)

    def prompt(self) -> dict:
        prompt: dict = {"prompt_token_ids": self.prompt_ids}
        if self.salt_hex:  # the connector names blocks with it; vLLM's own prefix cache isolates by it too
            prompt["cache_salt"] = self.salt_hex
        return prompt


@dataclass(slots=True)
class _Ran:
    """A run that reached its end: its stream (to be finished), why it ended, what vLLM found cached."""

    stream: TokenStream
    reason: str
    first_at: float  # perf_counter of its first output
    engine_cached: int  # tokens vLLM did not compute: its own prefix cache plus what the connector loaded


@dataclass
class VLLMWorker:
    worker_id: str
    llm: object  # vllm.v1.engine.async_llm.AsyncLLM
    publisher: Publisher
    block_size: int
    fingerprint: str = ""  # the connector's model fingerprint: names the blocks a handoff's handles point at
    settings: WorkerSettings = field(default_factory=WorkerSettings)
    constraints: ConstraintSettings = field(default_factory=ConstraintSettings)  # bounds of tool_choice grammars
    ledger: JobLedger = field(default_factory=JobLedger)
    active: int = 0  # requests in vLLM now (the heartbeat's load)
    _engine_ids: dict[str, tuple[int, str]] = field(default_factory=dict)  # request id -> (attempt, vLLM id)
    _slabs: SlabReader = field(default_factory=SlabReader)  # this worker's L2, as the connector keeps it

    def __post_init__(self) -> None:
        self.ledger.remember = self.settings.remember_finished

    async def handle(self, job: PrefillJob, msg=None) -> None:
        await run_once(self.ledger, job.request_id, job.attempt, lambda: self._prefill(job))

    async def handle_decode(self, job: DecodeJob, msg=None) -> None:
        await run_once(self.ledger, job.request_id, job.attempt, lambda: self._continue(job))

    def abort(self, request_id: str, attempt: int | None = None) -> None:
        """Stop the request here (every attempt, or `attempt` and older ones): shared/serving/ledger.stop_here."""
        stop_here(self.ledger, self._engine_ids, self._abort_in_vllm, request_id, attempt)

    def close(self) -> None:
        self._slabs.close()

    def _abort_in_vllm(self, engine_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self.llm.abort(engine_id))
        task.add_done_callback(lambda t: not t.cancelled() and t.exception() is not None
                               and log.warning("vLLM abort failed", error=repr(t.exception())))

    async def _fail(self, run: _Run, error: str, retriable: bool) -> None:
        log.warning("request failed", request_id=run.request_id, attempt=run.attempt, error=error)
        await publish_event(self.publisher, TokenEvent(
            request_id=run.request_id, attempt=run.attempt, seq=run.first_seq, prompt_tokens=run.prompt_tokens,
            worker_id=self.worker_id, finished=True, finish_reason="error", error=error, retriable=retriable))

    # -- jobs --------------------------------------------------------------

    async def _prefill(self, job: PrefillJob) -> None:
        try:
            bytes.fromhex(job.tenant_salt)
            subjects.token(job.decode_worker)
        except ValueError as exc:
            raise PermanentError(f"bad job: {exc}") from None
        # a constrained request decodes where it was prefilled: its grammar's state lives in this vLLM
        here = job.decode_worker == self.worker_id or job.sampling.constraint is not None
        try:
            params = _sampling(job.sampling, self.constraints, None if here else 1)
        except ConstraintError as exc:
            params, refused = None, f"constraint: {exc}"
        else:
            refused = _refusal(job.sampling, job.prefill_only)
        run = _Run(job.request_id, job.attempt, job.prompt_ids, job.tenant_salt, params, job.deadline,
                   prompt_tokens=len(job.prompt_ids))
        if refused:
            await self._fail(run, refused, retriable=False)
        elif time.time() >= job.deadline:
            await self._fail(run, "deadline passed before prefill started", retriable=True)
        elif here:
            await self._decode_here(job, run)
        else:
            await self._hand_off(job, run)

    async def _decode_here(self, job: PrefillJob, run: _Run) -> None:
        """The whole request on this worker, tokens from seq 0 (the first event carries the prompt's cached tokens:
        vLLM's own prefix cache plus what the connector loaded)."""
        t0 = time.perf_counter()
        ran = await self._to_the_end(run)
        if ran is None:
            return
        await ran.stream.finish(ran.reason, cache_created_tokens=self._created(job, ran.engine_cached))
        log.info("decoded here", request_id=job.request_id, attempt=job.attempt, session_id=job.session_id,
                 prompt_tokens=len(job.prompt_ids), cached_tokens=ran.engine_cached, engine="vllm",
                 ms={"engine": _ms(t0, ran.first_at), "decode": _ms(ran.first_at, time.perf_counter())})

    async def _hand_off(self, job: PrefillJob, run: _Run) -> None:
        """Prefill and the first token here, then the rest to `job.decode_worker`: a `DecodeJob` whose handles
        name the prompt's blocks in this worker's L2 slab, where the connector kept them as vLLM computed them."""
        t0 = time.perf_counter()
        outs: list = []
        try:
            reason = await self._generate(run, outs.append)
        except TimeoutError:
            await self._fail(run, "deadline passed during prefill", retriable=True)
            return
        except ValueError as exc:  # refused at admission (too long, bad parameters)
            await self._fail(run, str(exc), retriable=False)
            return
        if reason in (None, "abort") or not outs or self.ledger.stale(job.request_id, job.attempt):
            return  # aborted: the client left, or the request moved on
        ids = [t for o in outs for t in o.outputs[0].token_ids]
        text = "".join(o.outputs[0].text for o in outs)
        cached = outs[0].num_cached_tokens or 0
        created = self._created(job, cached)
        final = reason == "stop" or job.sampling.max_tokens <= len(ids)
        await publish_event(self.publisher, TokenEvent(
            request_id=job.request_id, attempt=job.attempt, seq=0, token_ids=ids, text=text, finished=final,
            finish_reason=reason if final else None, prompt_tokens=len(job.prompt_ids), cached_tokens=cached,
            cache_created_tokens=created, worker_id=self.worker_id))
        if final or self.ledger.aborted(job.request_id):
            return
        handles = self._handles(job.prompt_ids, job.tenant_salt)
        await self.publisher.publish(subjects.handoff(job.decode_worker), DecodeJob(
            request_id=job.request_id, attempt=job.attempt, session_id=job.session_id, tenant=job.tenant,
            tenant_salt=job.tenant_salt, prompt_ids=job.prompt_ids, generated=ids, sampling=job.sampling,
            handles=handles, prompt_tokens=len(job.prompt_ids), cached_tokens=cached, deadline=job.deadline,
            cache_created_tokens=created), msg_id=f"{job.request_id}:{job.attempt}")
        log.info("prefilled", request_id=job.request_id, attempt=job.attempt, session_id=job.session_id,
                 prompt_tokens=len(job.prompt_ids), cached_tokens=cached, handles=len(handles), engine="vllm",
                 decode_worker=job.decode_worker, ms={"engine": _ms(t0, time.perf_counter())})

    async def _continue(self, job: DecodeJob) -> None:
        """A handed-off (or migrated) request: vLLM runs prompt + the tokens already delivered, its connector
        loading the prompt's blocks from the owners the handles name (their L2 slabs, then S3), and the
        stream goes on from seq len(generated)."""
        try:
            bytes.fromhex(job.tenant_salt)
        except ValueError as exc:
            raise PermanentError(f"bad job: {exc}") from None
        left = job.sampling.max_tokens - len(job.generated)
        owners = tuple(dict.fromkeys(h.worker_id for h in job.handles if h.worker_id and h.worker_id != self.worker_id))
        refused = _refusal(job.sampling, prefill_only=False, continued=True)
        params = None if refused else _sampling(job.sampling, self.constraints, max(left, 1),
                                                {PEERS_PARAM: list(owners)} if owners else None)
        run = _Run(job.request_id, job.attempt, job.prompt_ids + job.generated, job.tenant_salt, params, job.deadline,
                   first_seq=len(job.generated), prompt_tokens=job.prompt_tokens, cached_tokens=job.cached_tokens)
        if refused:
            await self._fail(run, refused, retriable=False)
            return
        if time.time() >= job.deadline:
            await self._fail(run, "deadline passed before decode started", retriable=True)
            return
        if left <= 0:  # migrated with every token it may have: nothing more to compute
            stream = self._stream(run, job.cached_tokens)
            await stream.finish("length", cache_created_tokens=job.cache_created_tokens)
            return
        t0 = time.perf_counter()
        ran = await self._to_the_end(run)
        if ran is None:
            return
        await ran.stream.finish(ran.reason, cache_created_tokens=job.cache_created_tokens)
        log.info("decoded", request_id=job.request_id, attempt=job.attempt, session_id=job.session_id,
                 resumed_from=len(job.generated), engine_cached_tokens=ran.engine_cached, peers=list(owners),
                 engine="vllm", ms={"engine": _ms(t0, ran.first_at), "decode": _ms(ran.first_at, time.perf_counter())})

    # -- running vLLM --------------------------------------------------------

    async def _generate(self, run: _Run, on_output) -> str | None:
        """Run `run` in vLLM, each output (a delta) to `on_output`; its finish reason ("abort" or None when it was
        stopped). Raises TimeoutError past the deadline, ValueError when vLLM refuses it at admission."""
        engine_id = f"{run.request_id}:{run.attempt}"
        self._engine_ids[run.request_id] = (run.attempt, engine_id)
        self.active += 1
        reason = None
        try:
            async with asyncio.timeout(run.deadline - time.time()):
                async for out in self.llm.generate(run.prompt(), run.params, engine_id):
                    on_output(out)
                    reason = out.outputs[0].finish_reason if out.finished else None
        finally:
            self.active -= 1
            if self._engine_ids.get(run.request_id) == (run.attempt, engine_id):
                del self._engine_ids[run.request_id]
        return reason

    async def _to_the_end(self, run: _Run) -> _Ran | None:
        """Run `run`, streaming its tokens; None when it ended otherwise: failed (said on the stream), or stopped
        here (silent)."""
        stream: TokenStream | None = None
        first_at, engine_cached = 0.0, 0

        def on_output(out) -> None:
            nonlocal stream, first_at, engine_cached
            if stream is None:
                first_at, engine_cached = time.perf_counter(), out.num_cached_tokens or 0
                stream = self._stream(run, engine_cached if run.cached_tokens is None else run.cached_tokens)
            stream.add(list(out.outputs[0].token_ids), out.outputs[0].text)

        try:
            reason = await self._generate(run, on_output)
        except TimeoutError:
            await (stream.finish("error", error="deadline passed during decode") if stream is not None
                   else self._fail(run, "deadline passed during prefill", retriable=True))
            return None
        except ValueError as exc:  # vLLM refused it at admission: nothing was streamed
            await self._fail(run, str(exc), retriable=False)
            return None
        except BaseException:
            if stream is not None:
                stream.cancel()
            raise
        if stream is None or reason in (None, "abort"):  # aborted: migrated away, or the client left
            if stream is not None:
                stream.cancel()
            return None
        return _Ran(stream, reason, first_at, engine_cached)

    def _created(self, job: PrefillJob, cached_tokens: int) -> int:
        """The prompt tokens the job's pins wrote to the cache (the usage's cache_created_tokens)."""
        return cache_created(job.pins, (len(job.prompt_ids) - 1) // self.block_size, self.block_size, cached_tokens)

    def _stream(self, run: _Run, cached_tokens: int) -> TokenStream:
        return TokenStream(self.publisher, run.request_id, run.attempt, self.worker_id, run.first_seq,
                           run.prompt_tokens, cached_tokens,
                           fenced=lambda: self.ledger.stale(run.request_id, run.attempt))

    def _handles(self, prompt_ids: list[int], salt_hex: str) -> list[BlockHandle]:
        """The prompt's full blocks this worker's L2 slab holds, from position 0 up to the first it lacks."""
        n = len(prompt_ids) // self.block_size * self.block_size
        handles = []
        for h in chain_hashes(prompt_ids[:n], self.block_size, self.fingerprint, salt_hex):
            found = self._slabs.stat(self.worker_id, h, CHECKSUM_BYTES)
            if found is None:
                break
            size, checksum = found
            handles.append(BlockHandle(block_hash=h.hex(), tier=Tier.L2, worker_id=self.worker_id, size=size,
                                       checksum=checksum.hex()))
        return handles


def _refusal(sampling: SamplingSpec, prefill_only: bool, continued: bool = False) -> str:
    """Why a job cannot run on vLLM here ("" when it can). A constrained request that moved mid-answer (a
    migration) cannot go on elsewhere: vLLM's grammar state starts at the answer's first token."""
    if prefill_only:
        return "named caches (prefill_only) are not supported with engine.backend vllm"
    if continued and sampling.constraint is not None:
        return ("a constrained answer (tool_choice, response_format) cannot be continued on another vLLM worker; "
                "retry the request")
    return ""


def _sampling(spec: SamplingSpec, bounds: ConstraintSettings, max_tokens: int | None = None,
              kv_transfer_params: dict | None = None):
    """vLLM's sampling parameters for `spec` (`max_tokens`: the request's own unless given), with what the
    connector reads of the request (`kv_transfer_params`). A constraint becomes kvmesh's own grammar for it,
    run by vLLM's llguidance backend (`structured_outputs_config` in start_vllm): the same JSON bytes as
    kvmesh's engine writes, so the next turn's prefix hits. ConstraintError when it cannot be built."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    structured = None
    if spec.constraint is not None:
        structured = StructuredOutputsParams(grammar=lark_source(spec.constraint, bounds))

    return SamplingParams(max_tokens=spec.max_tokens if max_tokens is None else max_tokens,
                          temperature=spec.temperature, top_p=spec.top_p,
                          top_k=spec.top_k if spec.top_k > 0 else 0, seed=spec.seed, stop=list(spec.stop),
                          stop_token_ids=list(spec.stop_token_ids), ignore_eos=spec.ignore_eos,
                          output_kind=RequestOutputKind.DELTA, structured_outputs=structured,
                          extra_args={"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None)


def _ms(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round((b - a) * 1000, 2)


def start_vllm(ctx: ServiceContext):
    """vLLM's engine for this worker: the model dir, kvmesh's engine settings, the connector under this worker id
    (its fleet link joins as this worker: no heartbeat of its own, this user's inbox).

    Its KV pool is `engine.num_blocks` blocks and no more (vLLM's CPU default would claim 92% of RAM), and its
    threads run on every core this process may use, none reserved (vllm_cores.py; taskset, or vLLM's own
    VLLM_CPU_OMP_THREADS_BIND set for the service, gives it others)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    s = ctx.settings
    for name, value in bind_env(allowed_cores()).items():  # what the operator set stays
        os.environ.setdefault(name, value)
    # Compiled graphs live with the worker's state: a restart loads them instead of compiling for a minute.
    # Through torch's caches, not vLLM's AOT artifacts: in vLLM 0.32's CPU build those fail to load again
    # ("'function' object has no attribute 'finalize_loading'") and it compiles anew every start.
    os.environ.setdefault("VLLM_CACHE_ROOT", str(s.state_dir / "vllm-cache"))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(s.state_dir / "vllm-cache" / "inductor"))
    os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
    config = json.loads((s.model_dir / "config.json").read_text())
    # vLLM starts only if one sequence of max_model_len fits its pool (less the null block)
    max_len = min(int(config.get("max_position_embeddings", 2048)), (s.engine.num_blocks - 1) * s.engine.block_size)
    shape = parse_model_config(config, dtype=s.engine.dtype)  # vLLM keeps KV in the compute dtype
    block_bytes = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * shape.dtype.itemsize * s.engine.block_size
    args = AsyncEngineArgs(
        model=str(s.model_dir), dtype=s.engine.dtype, block_size=s.engine.block_size, max_model_len=max_len,
        enable_prefix_caching=s.engine.enable_prefix_caching, max_num_seqs=s.engine.max_num_seqs,
        max_num_batched_tokens=s.engine.max_num_batched_tokens, num_gpu_blocks_override=s.engine.num_blocks,
        kv_cache_memory_bytes=s.engine.num_blocks * block_bytes, disable_log_stats=True,
        structured_outputs_config={"backend": "guidance"},  # kvmesh's grammars are llguidance's (_sampling)
        kv_transfer_config={**CONNECTOR, "kv_connector_extra_config": {"worker_id": ctx.worker_id,
                                                                       "fleet_role": ctx.role.value}})
    return AsyncLLM.from_engine_args(args)


async def _start_worker(ctx: ServiceContext) -> VLLMWorker:
    """vLLM in this service's process, with its connector under the worker's id, as a `VLLMWorker`."""
    s = ctx.settings
    if s.model_dir is None:
        raise RuntimeError("KVMESH_MODEL_DIR is not set: a worker needs a checkpoint dir")
    fingerprint = await asyncio.to_thread(model_fingerprint, s.model_dir, s.engine.dtype)  # the connector's
    # vLLM's start (engine core process, weights, KV pool) blocks for tens of seconds: on a thread, so this
    # service's loop keeps answering NATS's pings; its client starts its tasks on this loop at the first request
    llm = await asyncio.to_thread(start_vllm, ctx)
    ctx.on_stop.append(lambda: asyncio.to_thread(llm.shutdown))
    worker = VLLMWorker(ctx.worker_id, llm, ctx.publisher, s.engine.block_size, fingerprint, s.workers,
                        s.engine.constraints)
    ctx.on_stop.append(lambda: asyncio.to_thread(worker.close))
    ctx.ready_check = lambda: not llm.errored
    ctx.load = lambda: float(worker.active)
    ctx.capacity = float(s.engine.max_num_seqs)
    ctx.l1_capacity_blocks = s.engine.num_blocks
    await listen_for_aborts(ctx, lambda a: worker.abort(a.request_id, a.attempt))
    return worker


async def setup_vllm_prefill(ctx: ServiceContext) -> None:
    """The prefill service with vLLM as its engine: what `setup_prefill` is for kvmesh's engine."""
    worker = await _start_worker(ctx)
    handler = typed(PrefillJob, worker.handle)
    for spec in (*own_job_consumers(Role.PREFILL, ctx.worker_id), PREFILL_ANY):
        ctx.add_consumer(job_consumer(spec, ctx.settings.engine.max_num_seqs), handler)


async def setup_vllm_decode(ctx: ServiceContext) -> None:
    """The decode service with vLLM as its engine: handoffs from vLLM prefill workers, and migrations."""
    worker = await _start_worker(ctx)
    handler = typed(DecodeJob, worker.handle_decode)
    for spec in (*own_job_consumers(Role.DECODE, ctx.worker_id), HANDOFF_ANY, DECODE_ANY):
        ctx.add_consumer(job_consumer(spec, ctx.settings.engine.max_num_seqs), handler)
