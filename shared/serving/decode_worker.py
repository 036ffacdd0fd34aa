"""The decode worker: resolve the handed-off blocks, decode with continuous batching, stream tokens.

For each `DecodeJob` (a prefill handoff, or the ingress migrating a request
here with every token delivered so far in `generated`), idempotent on
request_id + attempt:
1. the leading handles already in its engine (L1: e.g. last turn's blocks)
   are used as they are; the rest are fetched window by window
   (shared/serving/kv_fetch.py: own L2, the owner's shared memory or NATS in
   one batch per owner, L3 by the handle's object or by chunk key) and
   imported as they arrive, under a lease so they stay until the request
   runs, up to the first block that cannot be had; everything after that is
   recomputed (same tokens);
2. the request continues from prompt + generated (TokenEvent seq =
   len(generated) + i; text and stop strings continue from `generated`);
3. at the end the full blocks of prompt + output go to its L2 and the L3
   upload queue (so turn N+1 hits turn N's answer), then the final event is
   published and the job acked. A newer attempt of the same request arriving
   here supersedes this one, and an `AbortRequest` ends it (all attempts when
   the client went away; the attempt a migration replaced, and older ones,
   when it names one): either way it frees its sequence, stops without a
   final event and logs "decode attempt stopped". A stopped attempt's stream
   publishes nothing more, even tokens its engine produced before the abort
   was read (a worker paused mid-step and resumed); the ingress fences such
   an attempt anyway, by its attempt number.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field

from kvmesh.bus.consumer import PermanentError
from kvmesh.bus.publish import Publisher
from kvmesh.config import WorkerSettings
from kvmesh.engine.sampling import SamplingParams
from kvmesh.log import get_logger
from kvmesh.protocol.blocks import Tier
from kvmesh.protocol.serving import DecodeJob
from kvmesh.serving.audit import AuditCase, CacheAudit
from kvmesh.serving.engine_loop import RequestSpec
from kvmesh.serving.kv_fetch import (
    DEFAULT_WINDOW_BLOCKS,
    L2Source,
    L3Source,
    PeerSource,
    cached_run,
    fetch_chain,
)
from kvmesh.serving.kv_store import store_tokens
from kvmesh.serving.ledger import JobLedger, run_once, stop_here
from kvmesh.serving.runtime import WorkerRuntime
from kvmesh.serving.token_stream import TokenStream
from kvmesh.serving.worker_tiers import namespace_for
from nats.aio.msg import Msg

log = get_logger(__name__)


@dataclass
class DecodeWorker:
    worker_id: str
    rt: WorkerRuntime
    publisher: Publisher
    audit: CacheAudit | None = None
    settings: WorkerSettings = field(default_factory=WorkerSettings)
    ledger: JobLedger = field(default_factory=JobLedger)
    _engine_ids: dict[str, tuple[int, str]] = field(default_factory=dict)  # request id -> (attempt, engine id) run here

    def __post_init__(self) -> None:
        self.ledger.remember = self.settings.remember_finished

    async def handle(self, job: DecodeJob, msg: Msg | None = None) -> None:
        await run_once(self.ledger, job.request_id, job.attempt, lambda: self._run(job))

    async def _run(self, job: DecodeJob) -> None:
        try:
            salt = bytes.fromhex(job.tenant_salt)
        except ValueError as exc:
            raise PermanentError(f"bad job: {exc}") from None
        if self.rt.sessions is not None and job.session_id:
            self.rt.sessions.turn_started(job.session_id, job.prompt_ids, salt)
        stream = TokenStream(self.publisher, job.request_id, job.attempt, self.worker_id, len(job.generated),
                             job.prompt_tokens, job.cached_tokens,
                             fenced=lambda: self.ledger.stale(job.request_id, job.attempt))
        try:
            await self._decode(job, salt, stream)
        except BaseException:  # failed or drained away (the job is nak'ed): this stream says nothing more
            stream.cancel()
            raise

    async def _decode(self, job: DecodeJob, salt: bytes, stream: TokenStream) -> None:
        engine = self.rt.engine
        if time.time() >= job.deadline:
            await stream.finish("error", error="deadline passed before decode started")
            return
        engine_id = f"{job.request_id}:{job.attempt}:decode"
        try:
            t0 = time.perf_counter()
            sources = await self._resolve(job, salt, engine_id)
            log.info("decode blocks resolved", request_id=job.request_id, attempt=job.attempt,
                     handles=len(job.handles), sources={t.value: n for t, n in sources.items() if n},
                     ms=round((time.perf_counter() - t0) * 1000, 1))
            if self.ledger.stale(job.request_id, job.attempt):  # aborted or replaced while its blocks came
                stream.cancel()
                self._stopped(job)
                return
            older = self._engine_ids.pop(job.request_id, None)
            if older is not None:
                engine.abort(older[1])  # superseded by this attempt
            self._engine_ids[job.request_id] = (job.attempt, engine_id)
            spec = RequestSpec(engine_id, job.prompt_ids, SamplingParams.of(job.sampling), salt, generated=job.generated)
            try:
                out = await asyncio.wait_for(
                    engine.run_request(spec, lambda o: stream.add(o.new_token_ids, o.text_delta)),
                    job.deadline - time.time())
            except ValueError as exc:
                await stream.finish("error", error=str(exc), retriable=False)
                return
            except TimeoutError:
                await stream.finish("error", error="deadline passed during decode")
                return
            finally:
                if self._engine_ids.get(job.request_id) == (job.attempt, engine_id):
                    del self._engine_ids[job.request_id]
        finally:
            engine.release_lease(engine_id)  # the blocks fetched for a request that never ran
        if out.finish_reason == "abort":  # a newer attempt took over (here or elsewhere), or the client went away
            stream.cancel()
            self._stopped(job, len(out.token_ids))
            return
        produced = await self._register(job.prompt_ids + out.token_ids, salt, job.tenant_salt, job.session_id)
        await stream.finish(out.finish_reason, cache_created_tokens=job.cache_created_tokens)
        log.info("decoded", request_id=job.request_id, attempt=job.attempt, output_tokens=len(out.token_ids),
                 resumed_from=len(job.generated), sources={t.value: n for t, n in sources.items() if n},
                 registered_blocks=produced)
        if self.audit is not None and out.finish_reason in ("stop", "length"):
            case = AuditCase(job.request_id, job.prompt_ids, SamplingParams.of(job.sampling), salt, out.token_ids)
            self.audit.consider(case, max(job.cached_tokens, out.cached_tokens))

    async def _register(self, token_ids: list[int], salt: bytes, tenant_salt: str, session_id: str | None) -> int:
        """Full blocks of prompt + output into L2 (+ L3 queue); how many the chain has there now."""
        return len(await store_tokens(self.rt.engine, self.rt.tiers, token_ids, salt, tenant_salt, session_id))

    def abort(self, request_id: str, attempt: int | None = None) -> None:
        """Stop the request here (every attempt, or `attempt` and older ones): shared/serving/ledger.stop_here."""
        stop_here(self.ledger, self._engine_ids, self.rt.engine.abort, request_id, attempt)

    def _stopped(self, job: DecodeJob, produced: int = 0) -> None:
        why = ("aborted" if self.ledger.aborted(job.request_id)
               else "replaced" if self.ledger.stale(job.request_id, job.attempt) else "superseded here")
        log.info("decode attempt stopped", request_id=job.request_id, attempt=job.attempt, why=why,
                 output_tokens=produced)

    async def _resolve(self, job: DecodeJob, salt: bytes, lease: str) -> Counter:
        """Import the handles' blocks after those already in the engine, up to the first that cannot be had.

        Each handle's owner is asked for its run in one batch; L3 by the handle's object, else by
        chunk key (the prefill's upload may have landed even when its handles only name its L2).
        Returns the blocks per tier (L1 included); whatever is missing is recomputed.
        """
        tiers = self.rt.tiers
        handles = job.handles
        hashes, l1 = await cached_run(self.rt.engine, job.prompt_ids, salt, len(handles), lease)

        def owner(p: int) -> tuple[str, ...]:
            w = handles[p].worker_id
            return (w,) if w and w != self.worker_id else ()

        sources = [L2Source(tiers.l2)]
        if tiers.resolver.peers is not None:
            sources.append(PeerSource(tiers.resolver.peers, owner))
        if tiers.l3 is not None:
            sources.append(L3Source(tiers.l3, namespace_for(job.tenant_salt), search_partial=True,
                                    object_key=lambda p: handles[p].object_key))
        window = tiers.l3.chunk_blocks if tiers.l3 is not None else DEFAULT_WINDOW_BLOCKS
        fetched = await fetch_chain(self.rt.engine, hashes, l1, min(len(handles), len(hashes)), sources,
                                    tenant_salt=salt, lease=lease, window_blocks=window,
                                    inflight=self.settings.resolve_inflight)
        sources = Counter({Tier.L1: l1}) + fetched.sources
        if self.rt.tier_metrics is not None:
            self.rt.tier_metrics.observe("decode", sources, min(len(handles), len(hashes)), fetched.restore_s)
        return sources
