"""A kvmesh prefill worker whose engine is vLLM (`engine.backend = "vllm"`): jobs in, tokens out.

`python -m kvmesh.services.prefill` with `KVMESH_ENGINE__BACKEND=vllm` (what
`kvmesh up --engine vllm` starts) runs vLLM in process (`AsyncLLM`, its
engine core in a child process as always) with `KVMeshConnector` loaded under
the service's worker id. It is a prefill worker to the rest of the fleet: it
heartbeats as one and takes `PrefillJob`s from the same consumers, and the
ingress, finding no decode worker, names it as the job's `decode_worker`
(shared/ingress/routing/placement.py), so it runs every request to its end
here, as a kvmesh prefill worker does when it decodes locally:

- tokens stream from seq 0 through `TokenStream` (the first event carries the
  prompt's cached tokens: vLLM's own prefix cache plus what the connector
  loaded from L2 or L3);
- each (request, attempt) runs once (`JobLedger`), aborts and migrations
  fence it, the deadline ends it with a retriable error;
- the connector, not this worker, keeps the KV: every full block vLLM
  computes goes to the worker's L2 and S3, and its KV events, published under
  this worker's id, let the cache index and the ingress's router find them.

Not here (refused with a clear error, never served wrongly): decoding
constrained to a grammar (tool_choice, response_format) and named caches
(`prefill_only`). Pins are served as ordinary blocks: the connector keeps
every block, but nothing holds one for a TTL. The eviction service's advice
is not applied: vLLM's pool is vLLM's.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field

from kvmesh.bus.consumer import PermanentError, typed
from kvmesh.bus.publish import Publisher
from kvmesh.config import WorkerSettings
from kvmesh.log import get_logger
from kvmesh.protocol import subjects
from kvmesh.protocol.messages import Role
from kvmesh.protocol.serving import PrefillJob, SamplingSpec, TokenEvent
from kvmesh.protocol.streams import PREFILL_ANY
from kvmesh.service.runner import ServiceContext
from kvmesh.serving.ledger import JobLedger, run_once, stop_here
from kvmesh.serving.pinning import cache_created
from kvmesh.serving.runtime import job_consumer
from kvmesh.serving.services import listen_for_aborts, own_job_consumers
from kvmesh.serving.token_stream import TokenStream, publish_event

log = get_logger(__name__)

CONNECTOR = {"kv_connector": "KVMeshConnector", "kv_connector_module_path": "kvmesh.connectors.vllm",
             "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}


@dataclass
class VLLMWorker:
    worker_id: str
    llm: object  # vllm.v1.engine.async_llm.AsyncLLM
    publisher: Publisher
    block_size: int
    settings: WorkerSettings = field(default_factory=WorkerSettings)
    ledger: JobLedger = field(default_factory=JobLedger)
    active: int = 0  # requests in vLLM now (the heartbeat's load)
    _engine_ids: dict[str, tuple[int, str]] = field(default_factory=dict)  # request id -> (attempt, vLLM id)

    def __post_init__(self) -> None:
        self.ledger.remember = self.settings.remember_finished

    async def handle(self, job: PrefillJob, msg=None) -> None:
        await run_once(self.ledger, job.request_id, job.attempt, lambda: self._run(job))

    def abort(self, request_id: str, attempt: int | None = None) -> None:
        """Stop the request here (every attempt, or `attempt` and older ones): shared/serving/ledger.stop_here."""
        stop_here(self.ledger, self._engine_ids, self._abort_in_vllm, request_id, attempt)

    def _abort_in_vllm(self, engine_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self.llm.abort(engine_id))
        task.add_done_callback(lambda t: not t.cancelled() and t.exception() is not None
                               and log.warning("vLLM abort failed", error=repr(t.exception())))

    async def _fail(self, job: PrefillJob, error: str, retriable: bool) -> None:
        log.warning("request failed", request_id=job.request_id, attempt=job.attempt, error=error)
        await publish_event(self.publisher, TokenEvent(
            request_id=job.request_id, attempt=job.attempt, seq=0, prompt_tokens=len(job.prompt_ids),
            worker_id=self.worker_id, finished=True, finish_reason="error", error=error, retriable=retriable))

    async def _run(self, job: PrefillJob) -> None:
        try:
            bytes.fromhex(job.tenant_salt)
            subjects.token(job.decode_worker)
        except ValueError as exc:
            raise PermanentError(f"bad job: {exc}") from None
        refused = _refusal(job)
        if refused:
            await self._fail(job, refused, retriable=False)
            return
        if time.time() >= job.deadline:
            await self._fail(job, "deadline passed before prefill started", retriable=True)
            return
        prompt: dict = {"prompt_token_ids": job.prompt_ids}
        if job.tenant_salt:  # the connector names blocks with it; vLLM's own prefix cache isolates by it too
            prompt["cache_salt"] = job.tenant_salt
        engine_id = f"{job.request_id}:{job.attempt}"
        t0 = time.perf_counter()
        first_at = None
        stream: TokenStream | None = None
        finish_reason = None
        self._engine_ids[job.request_id] = (job.attempt, engine_id)
        self.active += 1
        try:
            async with asyncio.timeout(job.deadline - time.time()):
                async for out in self.llm.generate(prompt, _sampling(job.sampling), engine_id):
                    done = out.outputs[0]
                    if stream is None:
                        first_at = time.perf_counter()
                        stream = TokenStream(self.publisher, job.request_id, job.attempt, self.worker_id, 0,
                                             len(job.prompt_ids), out.num_cached_tokens or 0,
                                             fenced=lambda: self.ledger.stale(job.request_id, job.attempt))
                    stream.add(list(done.token_ids), done.text)
                    finish_reason = done.finish_reason if out.finished else None
        except TimeoutError:
            await (stream.finish("error", error="deadline passed during decode") if stream is not None
                   else self._fail(job, "deadline passed during prefill", retriable=True))
            return
        except ValueError as exc:  # vLLM refused it at admission (too long, bad parameters): nothing was streamed
            await self._fail(job, str(exc), retriable=False)
            return
        except BaseException:
            if stream is not None:
                stream.cancel()
            raise
        finally:
            self.active -= 1
            if self._engine_ids.get(job.request_id) == (job.attempt, engine_id):
                del self._engine_ids[job.request_id]
        if stream is None or finish_reason in (None, "abort"):  # aborted: migrated away, or the client left
            if stream is not None:
                stream.cancel()
            return
        full_blocks = (len(job.prompt_ids) - 1) // self.block_size
        created = cache_created(job.pins, full_blocks, self.block_size, stream.cached_tokens)
        await stream.finish(finish_reason, cache_created_tokens=created)
        log.info("decoded here", request_id=job.request_id, attempt=job.attempt, session_id=job.session_id,
                 prompt_tokens=len(job.prompt_ids), cached_tokens=stream.cached_tokens, engine="vllm",
                 ms={"engine": _ms(t0, first_at), "decode": _ms(first_at, time.perf_counter())})


def _refusal(job: PrefillJob) -> str:
    """Why this job cannot run on vLLM here ("" when it can)."""
    if job.prefill_only:
        return "named caches (prefill_only) are not supported with engine.backend vllm"
    if job.sampling.constraint is not None:
        return ("constrained decoding (tool_choice, response_format) is not supported with engine.backend vllm; "
                "serve it with kvmesh's engine")
    return ""


def _sampling(spec: SamplingSpec):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(max_tokens=spec.max_tokens, temperature=spec.temperature, top_p=spec.top_p,
                          top_k=spec.top_k if spec.top_k > 0 else 0, seed=spec.seed, stop=list(spec.stop),
                          stop_token_ids=list(spec.stop_token_ids), ignore_eos=spec.ignore_eos,
                          output_kind=RequestOutputKind.DELTA)


def _ms(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round((b - a) * 1000, 2)


def start_vllm(ctx: ServiceContext):
    """vLLM's engine for this worker: the model dir, kvmesh's engine settings, the connector under this worker id
    (its fleet link joins as this worker: no heartbeat of its own, this user's inbox)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    s = ctx.settings
    if s.engine.threads:
        os.environ.setdefault("OMP_NUM_THREADS", str(s.engine.threads))
    config = json.loads((s.model_dir / "config.json").read_text())
    # vLLM starts only if one sequence of max_model_len fits its pool (less the null block)
    max_len = min(int(config.get("max_position_embeddings", 2048)), (s.engine.num_blocks - 1) * s.engine.block_size)
    args = AsyncEngineArgs(
        model=str(s.model_dir), dtype=s.engine.dtype, block_size=s.engine.block_size, max_model_len=max_len,
        enable_prefix_caching=s.engine.enable_prefix_caching, max_num_seqs=s.engine.max_num_seqs,
        max_num_batched_tokens=s.engine.max_num_batched_tokens, num_gpu_blocks_override=s.engine.num_blocks,
        disable_log_stats=True,
        kv_transfer_config={**CONNECTOR, "kv_connector_extra_config": {"worker_id": ctx.worker_id,
                                                                       "fleet_role": ctx.role.value}})
    return AsyncLLM.from_engine_args(args)


async def setup_vllm_prefill(ctx: ServiceContext) -> None:
    """The prefill service with vLLM as its engine: what `setup_prefill` is for kvmesh's engine."""
    s = ctx.settings
    if s.model_dir is None:
        raise RuntimeError("KVMESH_MODEL_DIR is not set: a worker needs a checkpoint dir")
    llm = start_vllm(ctx)  # on the event loop, as vLLM's own server does (its client binds to this loop)
    ctx.on_stop.append(lambda: asyncio.to_thread(llm.shutdown))
    worker = VLLMWorker(ctx.worker_id, llm, ctx.publisher, s.engine.block_size, s.workers)
    ctx.ready_check = lambda: not llm.errored
    ctx.load = lambda: float(worker.active)
    ctx.capacity = float(s.engine.max_num_seqs)
    ctx.l1_capacity_blocks = s.engine.num_blocks
    await listen_for_aborts(ctx, lambda a: worker.abort(a.request_id, a.attempt))
    handler = typed(PrefillJob, worker.handle)
    for spec in (*own_job_consumers(Role.PREFILL, ctx.worker_id), PREFILL_ANY):
        ctx.add_consumer(job_consumer(spec, s.engine.max_num_seqs), handler)
