"""The prefill worker: reach the longest cached prefix, compute the rest, hand decode the blocks.

For each `PrefillJob` (idempotent on request_id + attempt):
1. import the longest prefix it can reach (shared/serving/prefix_reach.py), under the request's lease;
2. run the prompt for one token (the first token);
3. register the prompt's full blocks in its L2 (+ queued L3 upload) and pin
   what the job's `pins` ask for;
4. publish TokenEvent seq 0 (before step 3: the first token does not wait
   for the tiers; nor does a final one, unless the job pins), then the
   `DecodeJob` (handles + first token) to `handoff(decode_worker)`; the job
   is acked once that publish is.
If the first token ends the request (eos, stop string, max_tokens 1) the
seq-0 event is final and nothing is handed off. A job whose `decode_worker`
is this worker (the ingress found a handoff would not pay:
shared/ingress/routing/placement.py) runs to its end here instead: tokens
stream from seq 0, and prompt + output go to the tiers after the final
event (before it when the request pins), as a decode worker's would. A named-cache job
(`prefill_only`) writes its blocks to L3 with its TTL, waits for the write
and reports with one final event without tokens.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from kvmesh.bus.consumer import PermanentError
from kvmesh.bus.publish import Publisher
from kvmesh.config import WorkerSettings
from kvmesh.engine.detokenizer import IncrementalDetokenizer
from kvmesh.engine.request import RequestOutput
from kvmesh.engine.sampling import SamplingParams
from kvmesh.log import get_logger
from kvmesh.protocol import subjects
from kvmesh.protocol.serving import DecodeJob, PrefillJob, TokenEvent
from kvmesh.serving.engine_loop import RequestSpec, cached_lease
from kvmesh.serving.kv_store import store_chain, store_tokens
from kvmesh.serving.ledger import JobLedger, run_once, stop_here
from kvmesh.serving.pinning import L2Pins, apply_pins, cache_created
from kvmesh.serving.prefill_stream import PrefillStream
from kvmesh.serving.prefix_reach import Reach, reach_prefix
from kvmesh.serving.runtime import WorkerRuntime
from kvmesh.serving.token_stream import TokenStream, publish_event
from kvmesh.tiers.namespace import namespace_for
from kvmesh.traffic.tiers import tier_tokens
from nats.aio.msg import Msg

log = get_logger(__name__)


@dataclass
class PrefillWorker:
    worker_id: str
    rt: WorkerRuntime
    publisher: Publisher
    settings: WorkerSettings = field(default_factory=WorkerSettings)
    ledger: JobLedger = field(default_factory=JobLedger)
    _engine_ids: dict[str, tuple[int, str]] = field(default_factory=dict)  # request id -> (attempt, engine id) here
    l2_pins: L2Pins | None = None  # this worker's L2 pin budget (None: L2 bounds its pins by itself)

    def __post_init__(self) -> None:
        self.ledger.remember = self.settings.remember_finished

    async def handle(self, job: PrefillJob, msg: Msg | None = None) -> None:
        await run_once(self.ledger, job.request_id, job.attempt, lambda: self._run(job))

    def abort(self, request_id: str, attempt: int | None = None) -> None:
        """Stop the request here (every attempt, or `attempt` and older ones): shared/serving/ledger.stop_here."""
        stop_here(self.ledger, self._engine_ids, self.rt.engine.abort, request_id, attempt)

    def _event(self, job: PrefillJob, **kw) -> TokenEvent:
        return TokenEvent(request_id=job.request_id, attempt=job.attempt, seq=0, prompt_tokens=len(job.prompt_ids),
                          worker_id=self.worker_id, **kw)

    async def _fail(self, job: PrefillJob, error: str, retriable: bool) -> None:
        log.warning("prefill failed", request_id=job.request_id, attempt=job.attempt, error=error)
        await publish_event(self.publisher, self._event(job, finished=True, finish_reason="error", error=error,
                                                        retriable=retriable))

    async def _run(self, job: PrefillJob) -> None:
        try:
            salt = bytes.fromhex(job.tenant_salt)
            subjects.token(job.decode_worker)
        except ValueError as exc:
            raise PermanentError(f"bad job: {exc}") from None
        if self.rt.sessions is not None and job.session_id:
            self.rt.sessions.turn_started(job.session_id, job.prompt_ids, salt)
        if time.time() >= job.deadline:
            await self._fail(job, "deadline passed before prefill started", retriable=True)
            return
        engine = self.rt.engine
        t0 = time.perf_counter()
        peers = self.rt.peers.ids() if self.settings.probe_peers else []
        engine_id = f"{job.request_id}:{job.attempt}:prefill"
        try:
            # The reached blocks are imported as they arrive, under the request's lease: they stay
            # in the pool until the request runs (it adopts the lease) or the lease is released.
            reach = await reach_prefix(engine, self.rt.tiers, peers, job.prompt_ids, job.tenant_salt,
                                       self.publisher.nc, prefix_worker=job.prefix_worker, lease=engine_id,
                                       inflight=self.settings.resolve_inflight, gate=self.rt.restore_gate,
                                       l3_blocks=job.l3_blocks)
            if self.ledger.stale(job.request_id, job.attempt):
                return
            if job.decode_worker == self.worker_id and not job.prefill_only:
                await self._decode_here(job, reach, salt, engine_id, reach_ms=_ms(t0, time.perf_counter()))
                return
            stream = self._stream(job, reach)
            spec = RequestSpec(engine_id, job.prompt_ids, SamplingParams.of(job.sampling, max_tokens=1), salt,
                               on_cached=stream.add if stream is not None else None)
            self._engine_ids[job.request_id] = (job.attempt, engine_id)
            t1 = time.perf_counter()
            try:
                out = await asyncio.wait_for(engine.run_request(spec, lambda _: None), job.deadline - time.time())
            except ValueError as exc:
                await self._fail(job, str(exc), retriable=False)
                return
            except TimeoutError:
                await self._fail(job, "deadline passed during prefill", retriable=True)
                return
            finally:
                self._engine_ids.pop(job.request_id, None)
                if stream is not None:  # stored, or given up: the engine may let the views' blocks go
                    await stream.close()
                    engine.release_lease(cached_lease(engine_id))
        finally:
            engine.release_lease(engine_id)  # the blocks fetched for a request that never ran
        if out.finish_reason == "abort":  # the client went away: publish nothing more
            return
        self._observe_compute(job, out)
        if self.rt.tier_metrics is not None:
            usable = (len(job.prompt_ids) - 1) // engine.engine.block_size
            self.rt.tier_metrics.observe("prefill", reach.sources, usable, reach.restore_s)
        created = cache_created(job.pins, len(reach.hashes), engine.engine.block_size, out.cached_tokens)
        usage = {"cached_tokens": out.cached_tokens, "cache_created_tokens": created,
                 "tier_tokens": tier_tokens(reach.sources, engine.engine.block_size, out.cached_tokens)}
        first = out.token_ids[0] if out.token_ids else None
        t2 = time.perf_counter()
        final_now = out.finish_reason == "stop" or job.sampling.max_tokens == 1
        final = self._event(job, token_ids=[first], text=out.text, finished=True, finish_reason=out.finish_reason,
                            **usage) if final_now else None
        # The first token goes out before the blocks are stored: TTFT does not wait for L2. A final one
        # too, unless the request pins blocks (the answer then means they are pinned).
        final_sent = False
        if not job.prefill_only and not self.ledger.aborted(job.request_id):
            if not final_now:
                detok = IncrementalDetokenizer(self.rt.loaded.tokenizer, job.prompt_ids, job.sampling.stop)
                detok.add(first)
                # The decode worker primes its detokenizer with this token and continues from the same point.
                await publish_event(self.publisher, self._event(job, token_ids=[first],
                                                                text=detok.take_delta(False), **usage))
            elif not job.pins and final is not None:
                await publish_event(self.publisher, final)
                final_sent = True
        t3 = time.perf_counter()
        tiers = self.rt.tiers
        handles, chain = await store_chain(engine, tiers, reach.hashes, job.tenant_salt, session_id=job.session_id,
                                           keep_chain=job.prefill_only)
        if job.pins:
            await apply_pins(engine, tiers, job.pins, reach.hashes, namespace_for(job.tenant_salt), self.l2_pins)
        log.info("prefilled", request_id=job.request_id, attempt=job.attempt, prompt_tokens=len(job.prompt_ids),
                 cached_tokens=out.cached_tokens, sources={t.value: n for t, n in reach.sources.items() if n},
                 handles=len(handles), ms={"reach": _ms(t0, t1), "engine": _ms(t1, t2), "token0": _ms(t2, t3),
                                           "store": _ms(t3, time.perf_counter())})
        if job.prefill_only:
            await self._named_cache(job, chain, out.cached_tokens, created)
            return
        if self.ledger.aborted(job.request_id):  # the client left while this ran: hand nothing on
            return
        if final is not None:
            if not final_sent:
                await publish_event(self.publisher, final)
            return
        handoff = DecodeJob(
            request_id=job.request_id, attempt=job.attempt, session_id=job.session_id, tenant=job.tenant,
            tenant_salt=job.tenant_salt, prompt_ids=job.prompt_ids, generated=[first], sampling=job.sampling,
            handles=handles, prompt_tokens=len(job.prompt_ids), cached_tokens=out.cached_tokens,
            deadline=job.deadline, cache_created_tokens=created,
        )
        await self.publisher.publish(subjects.handoff(job.decode_worker), handoff,
                                     msg_id=f"{job.request_id}:{job.attempt}")

    def _stream(self, job: PrefillJob, reach: Reach) -> PrefillStream | None:
        """A handoff's prompt, stored and pulled by the decode worker step by step while it is prefilled."""
        if job.prefill_only or not self.settings.stream_handoff or job.decode_worker == subjects.ANY:
            return None
        return PrefillStream(self.rt.tiers, self.publisher, f"{job.request_id}:{job.attempt}", list(reach.hashes),
                             job.tenant_salt, self.worker_id, job.decode_worker, self.settings.stream_hold_s,
                             job.session_id)

    async def _decode_here(self, job: PrefillJob, reach: Reach, salt: bytes, engine_id: str, reach_ms: float) -> None:
        """Run the request to its end on this worker: tokens from seq 0 (the first event carries the prefill's
        usage), then prompt + output into the tiers; pins are applied before the final event.

        Logs `decoded here` with the spans `reach`, `engine` (to the first token), `decode` (to the last),
        `finish` (pins, the final event) and `store`, in that order, ending at the line's timestamp."""
        engine, block_size = self.rt.engine, self.rt.engine.engine.block_size
        t0 = first_at = time.perf_counter()
        stream: TokenStream | None = None

        def on_output(o: RequestOutput) -> None:
            nonlocal stream, first_at
            if stream is None:
                first_at = time.perf_counter()
                stream = TokenStream(self.publisher, job.request_id, job.attempt, self.worker_id, 0,
                                     len(job.prompt_ids), o.cached_tokens,
                                     fenced=lambda: self.ledger.stale(job.request_id, job.attempt),
                                     tier_tokens=tier_tokens(reach.sources, block_size, o.cached_tokens))
            stream.add(o.new_token_ids, o.text_delta)

        spec = RequestSpec(engine_id, job.prompt_ids, SamplingParams.of(job.sampling), salt)
        self._engine_ids[job.request_id] = (job.attempt, engine_id)
        try:
            out = await asyncio.wait_for(engine.run_request(spec, on_output), job.deadline - time.time())
        except ValueError as exc:  # refused at admission: nothing was streamed
            await self._fail(job, str(exc), retriable=False)
            return
        except TimeoutError:
            await (stream.finish("error", error="deadline passed during decode") if stream is not None
                   else self._fail(job, "deadline passed during prefill", retriable=True))
            return
        except BaseException:
            if stream is not None:
                stream.cancel()
            raise
        finally:
            if self._engine_ids.get(job.request_id) == (job.attempt, engine_id):
                del self._engine_ids[job.request_id]
        if out.finish_reason == "abort" or stream is None:  # migrated away, or the client went away
            if stream is not None:
                stream.cancel()
            return
        self._observe_compute(job, out)
        if self.rt.tier_metrics is not None:
            usable = (len(job.prompt_ids) - 1) // block_size
            self.rt.tier_metrics.observe("prefill", reach.sources, usable, reach.restore_s)
        created = cache_created(job.pins, len(reach.hashes), block_size, out.cached_tokens)
        t1 = time.perf_counter()
        if job.pins:
            await self._store_output(job, out.token_ids, salt)
            await apply_pins(engine, self.rt.tiers, job.pins, reach.hashes, namespace_for(job.tenant_salt),
                             self.l2_pins)
        await stream.finish(out.finish_reason, cache_created_tokens=created)
        t2 = time.perf_counter()
        if not job.pins:
            await self._store_output(job, out.token_ids, salt)
        log.info("decoded here", request_id=job.request_id, attempt=job.attempt, prompt_tokens=len(job.prompt_ids),
                 cached_tokens=out.cached_tokens, output_tokens=len(out.token_ids),
                 sources={t.value: n for t, n in reach.sources.items() if n},
                 ms={"reach": reach_ms, "engine": _ms(t0, first_at), "decode": _ms(first_at, t1), "finish": _ms(t1, t2),
                     "store": _ms(t2, time.perf_counter())})

    def _observe_compute(self, job: PrefillJob, out: RequestOutput) -> None:
        """This worker's prefill rate, for the restore gate: the engine's time to the first token per computed token."""
        if self.rt.restore_gate is not None:
            self.rt.restore_gate.observe_compute(out.ttft, len(job.prompt_ids) - out.cached_tokens)

    async def _store_output(self, job: PrefillJob, output_ids: list[int], salt: bytes) -> None:
        """Full blocks of prompt + output into L2 (+ L3 queue): the next turn's prefix."""
        await store_tokens(self.rt.engine, self.rt.tiers, job.prompt_ids + output_ids, salt, job.tenant_salt,
                           job.session_id)

    async def _named_cache(self, job: PrefillJob, chain: list, cached: int, created: int) -> None:
        ttl = max((p.ttl_s for p in job.pins), default=self.rt.tiers.l3.ttl_s if self.rt.tiers.l3 else 0.0)
        try:
            ok = await asyncio.wait_for(self.rt.tiers.write_l3_now(chain, job.tenant_salt, ttl),
                                        self.settings.l3_wait_s)
        except TimeoutError:
            ok = False
        if not ok:
            await self._fail(job, "named cache not written to L3 (object storage unavailable)", retriable=True)
            return
        await publish_event(self.publisher, self._event(job, finished=True, finish_reason="stop", cached_tokens=cached,
                                                        cache_created_tokens=created))


def _ms(a: float, b: float) -> float:
    return round((b - a) * 1000, 2)
