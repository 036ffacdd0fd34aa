"""The in-process engine: requests in, tokens out, KV blocks reusable across requests.

`Engine` owns the KV pool tensor, the prefix cache and the scheduler.
`step()` runs one scheduler step (one forward pass) and reports the
requests that got tokens or finished. Finished requests leave their full
blocks (prompt + output) cached, so the next turn of a conversation hits.
`export_blocks` / `import_blocks` move cached blocks out of and into the
pool as `KVBlock`s (tiers, prefill -> decode handoff); an import under a
lease named like a request keeps its blocks until that request ends
(shared/engine/leases.py).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from kvmesh.cache_policy.base import EvictionPolicy
from kvmesh.cache_policy.registry import get_policy
from kvmesh.config import EngineSettings
from kvmesh.engine.batch_builder import build_forward_batch
from kvmesh.engine.block_pool import BlockPool
from kvmesh.engine.block_transfer import (
    ImportResult,
    PendingExport,
    import_chain,
    start_export,
)
from kvmesh.engine.constraints import EngineConstraints
from kvmesh.engine.detokenizer import IncrementalDetokenizer
from kvmesh.engine.kv_block import KVBlock
from kvmesh.engine.leases import LeaseSet
from kvmesh.engine.loader import LoadedModel
from kvmesh.engine.pins import PinSet
from kvmesh.engine.prefix_cache import KVEventListener, PrefixCache
from kvmesh.engine.request import Request, RequestOutput
from kvmesh.engine.sampling import SamplingParams, make_generator, sample, skip_draws
from kvmesh.engine.scheduler import ScheduledSeq, Scheduler
from kvmesh.kernels.block_copy import SideStreamCopier
from kvmesh.protocol.block_hash import BlockHash, HashKeys, hash_blocks


class Engine:
    """One model, one KV pool. `policy` overrides settings.eviction_policy; `listener` hears block stored/removed."""

    def __init__(
        self,
        loaded: LoadedModel,
        settings: EngineSettings,
        policy: EvictionPolicy | None = None,
        listener: KVEventListener | None = None,
    ) -> None:
        cfg = loaded.config
        self.loaded = loaded
        self.settings = settings
        self.block_size = settings.block_size
        # The pool holds K/V in the model's KV dtype (its compute dtype unless the config says otherwise).
        self.kv_cache = torch.zeros(
            (cfg.num_layers, 2, settings.num_blocks, settings.block_size, cfg.num_kv_heads, cfg.head_dim),
            dtype=cfg.kv_dtype,
            device=settings.device,
        )
        block_bytes = cfg.kv_bytes_per_token() * settings.block_size
        if policy is None:
            policy = get_policy(settings.eviction_policy)
        self.cache = PrefixCache(BlockPool(settings.num_blocks), settings.block_size, policy, listener, block_bytes=block_bytes)
        self.leases = LeaseSet(self.cache)
        self.pins = PinSet(self.cache, int(settings.pin_fraction * settings.num_blocks),
                           int(settings.pin_tenant_fraction * settings.num_blocks))
        # Pins and leases are advice the scheduler may take back when nothing could run otherwise.
        self.scheduler = Scheduler(settings, self.cache, self.leases, self.pins)
        # On CUDA, exports and imports run on a side stream through pinned memory (kernels/block_copy.py).
        self._copier = SideStreamCopier(self.kv_cache.device) if self.kv_cache.is_cuda else None
        self._requests: dict[str, Request] = {}
        self._pending: list[RequestOutput] = []  # aborted requests, reported by the next step
        self._keys: dict[tuple[bytes, str], HashKeys] = {}
        self._eos = frozenset(cfg.eos_token_ids)
        self._max_len = cfg.max_position_embeddings
        self.constraints = EngineConstraints(loaded, settings.constraints, on_accelerator=self.kv_cache.device.type != "cpu")

    # --- requests ------------------------------------------------------

    def hash_keys(self, tenant_salt: bytes = b"", adapter: str = "") -> HashKeys:
        keys = self._keys.get((tenant_salt, adapter))
        if keys is None:
            keys = HashKeys(self.loaded.fingerprint, tenant_salt, adapter)
            self._keys[(tenant_salt, adapter)] = keys
        return keys

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        tenant_salt: bytes = b"",
        adapter: str = "",
        generated: Sequence[int] = (),
        use_cache: bool = True,
    ) -> None:
        """Queue a request; ValueError for an empty prompt, ids outside the vocab, one past the context, a duplicate id.

        `generated`: output tokens already produced elsewhere (a migrated request): they count as
        output (max_tokens, stop strings, detokenization continue from them) and are not re-reported.
        If they already end the request (a stop token, a stop string, a complete grammar, max_tokens:
        the first worker's final event was lost), the next step reports it finished with that reason
        and no new token, without running it.
        `use_cache=False` computes the whole prompt cold (the cache audit).
        A lease named `request_id` (blocks imported for it) is adopted: it ends when the request
        finishes or is aborted. A request that raises here leaves it to `release_lease`.
        """
        if not prompt_ids:
            raise ValueError(f"request {request_id!r}: empty prompt")
        if len(generated) > params.max_tokens:
            raise ValueError(f"request {request_id!r}: {len(generated)} tokens already generated, max_tokens {params.max_tokens}")
        all_ids = [*prompt_ids, *generated]
        if min(all_ids) < 0 or max(all_ids) >= self.loaded.config.vocab_size:
            raise ValueError(f"request {request_id!r}: token ids must be in [0, {self.loaded.config.vocab_size})")
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already exists")
        total = len(prompt_ids) + params.max_tokens
        if total > self._max_len:
            raise ValueError(
                f"request {request_id!r}: prompt ({len(prompt_ids)} tokens) + max_tokens "
                f"({params.max_tokens}) = {total} exceeds the context of {self._max_len} tokens"
            )
        if -(-total // self.block_size) > self.settings.num_blocks:
            raise ValueError(f"request {request_id!r}: needs more KV blocks than the pool has ({self.settings.num_blocks})")
        if params.stop and not params.detokenize:
            raise ValueError(f"request {request_id!r}: stop strings need detokenize=True")
        req = Request(
            request_id=request_id,
            token_ids=all_ids,
            num_prompt_tokens=len(prompt_ids),
            params=params,
            keys=self.hash_keys(tenant_salt, adapter),
            block_size=self.block_size,
            arrival_time=time.monotonic(),
            generator=make_generator(params),
            use_cache=use_cache,
        )
        skip_draws(req.generator, len(generated), self.loaded.config.vocab_size)  # seeded sampling continues
        self.constraints.attach(req, generated)  # the grammar continues too (ConstraintError is a ValueError)
        stop_token = bool(generated) and self._is_stop_token(generated[-1], params)
        if params.detokenize:
            req.detokenizer = IncrementalDetokenizer(self.loaded.tokenizer, prompt_ids, params.stop)
            # Prime: text and stop-string state continue where the first worker was (which never
            # fed a stop token to its detokenizer).
            for tok in generated[: len(generated) - stop_token]:
                req.detokenizer.add(tok)
            req.detokenizer.take_delta(False)
        req.finish_reason = self._ended_before_start(req, stop_token)
        if req.finish_reason is not None:
            self.leases.release(request_id)
            self._pending.append(self._output(req, [], time.monotonic()))
            return
        self._requests[request_id] = req
        self.scheduler.add(req)

    def _is_stop_token(self, tok: int, p: SamplingParams) -> bool:
        return tok in p.stop_token_ids or (not p.ignore_eos and tok in self._eos)

    @staticmethod
    def _ended_before_start(req: Request, stop_token: bool) -> str | None:
        """How the tokens a migrated request brings already end it, if they do (as `_advance` would have)."""
        if stop_token or (req.detokenizer is not None and req.detokenizer.stopped) or EngineConstraints.done(req):
            return "stop"
        return "length" if req.num_output_tokens >= req.params.max_tokens else None

    def abort(self, request_id: str) -> None:
        """Stop a request now; the next `step()` reports it finished with reason "abort".

        A request not added (yet) has only its lease, if any, ended.
        """
        req = self._requests.pop(request_id, None)
        if req is None:
            self.leases.release(request_id)
            return
        self.scheduler.remove(req)
        req.finish_reason = "abort"
        self._pending.append(self._output(req, [], time.monotonic()))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    # --- one step ------------------------------------------------------

    def pin(self, hashes: Sequence[BlockHash], until: float) -> int:
        """Keep the leading cached run of `hashes` until `until` (unix seconds); returns how many blocks."""
        return self.pins.pin(hashes, until)

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        if self.pins:
            self.pins.expire(time.time())
        outputs, self._pending = self._pending, []
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return outputs
        batch = build_forward_batch(scheduled, self.block_size, self.settings.device)
        rows = [i for i, s in enumerate(scheduled) if s.sample]
        sampled: list[ScheduledSeq] = [scheduled[i] for i in rows]
        masks = self.constraints.start([s.request for s in sampled])  # filled while the forward runs
        logits = self.loaded.model(batch, self.kv_cache)
        self.scheduler.commit(scheduled)
        if not rows:
            return outputs
        if len(rows) != len(scheduled):
            logits = logits[torch.tensor(rows, device=logits.device)]
        logits = logits.float()
        self.constraints.apply(masks, logits)
        tokens = sample(
            logits,
            [s.request.params for s in sampled],
            [s.request.generator for s in sampled],
        )
        now = time.monotonic()
        for s, tok in zip(sampled, tokens):
            outputs.append(self._advance(s.request, tok, now))
        return outputs

    def _advance(self, req: Request, tok: int, now: float) -> RequestOutput:
        req.append_token(tok)
        if req.first_token_time is None:
            req.first_token_time = now
        p = req.params
        complete = self.constraints.advance(req, tok)  # the grammar is complete: nothing else may follow
        if self._is_stop_token(tok, p):
            req.finish_reason = "stop"
        elif req.detokenizer is not None and req.detokenizer.add(tok):
            req.finish_reason = "stop"
        elif complete:
            req.finish_reason = "stop"
        elif req.num_output_tokens >= p.max_tokens:
            req.finish_reason = "length"
        if req.finish_reason is not None:
            self.scheduler.remove(req)
            del self._requests[req.request_id]
        return self._output(req, [tok], now)

    def _output(self, req: Request, new: list[int], now: float) -> RequestOutput:
        finished = req.finish_reason is not None
        detok = req.detokenizer
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=new,
            token_ids=req.output_ids,
            text_delta=detok.take_delta(finished) if detok is not None else "",
            text=detok.text if detok is not None else "",
            finished=finished,
            finish_reason=req.finish_reason,
            prompt_tokens=req.num_prompt_tokens,
            cached_tokens=req.cached_tokens or 0,
            arrival_time=req.arrival_time,
            first_token_time=req.first_token_time,
            finished_time=now if finished else None,
        )

    # --- convenience ---------------------------------------------------

    def generate(
        self,
        prompts: Sequence[list[int]],
        params: SamplingParams | Sequence[SamplingParams],
        tenant_salt: bytes = b"",
        adapter: str = "",
    ) -> list[RequestOutput]:
        """Run the prompts (batched together) to completion; final outputs in prompt order."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise ValueError("one SamplingParams per prompt, or one for all")
        base = f"gen-{id(self)}-{time.monotonic_ns()}"
        ids = [f"{base}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, list(prompt), p, tenant_salt, adapter)
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] for rid in ids]

    # --- cache surface -------------------------------------------------

    def block_hashes(self, prompt_ids: Sequence[int], tenant_salt: bytes = b"", adapter: str = "") -> list[BlockHash]:
        """Chained hashes of the full blocks of prompt_ids."""
        return hash_blocks(prompt_ids, self.block_size, self.hash_keys(tenant_salt, adapter))

    def cached_prefix_tokens(self, prompt_ids: Sequence[int], tenant_salt: bytes = b"", adapter: str = "") -> int:
        """How many leading tokens of prompt_ids are in the pool now (no side effects)."""
        hashes = self.block_hashes(prompt_ids, tenant_salt, adapter)
        return len(self.cache.lookup(hashes, prompt_ids)) * self.block_size

    def export_blocks(self, hashes: Sequence[BlockHash]) -> list[KVBlock]:
        """The leading run of `hashes` that is cached, as KVBlocks with CPU tensors."""
        return self.start_export(hashes).wait()

    def start_export(self, hashes: Sequence[BlockHash]) -> PendingExport:
        """`export_blocks` whose host copy may still be in flight (CUDA): call `wait()` off the engine thread."""
        return start_export(self.cache, self.kv_cache, hashes, self._copier)

    def drop_blocks(self, hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """Uncache those of `hashes` that are, or become once their dropped children are gone, unreferenced leaves.

        Any order: passes repeat while one makes progress. Returns the dropped hashes in drop order.
        """
        dropped: list[BlockHash] = []
        pending = list(hashes)
        while pending:
            left = []
            for h in pending:
                (dropped if self.cache.drop(h) else left).append(h)
            if len(left) == len(pending):
                break
            pending = left
        return dropped

    def import_blocks(self, blocks: Sequence[KVBlock], tenant_salt: bytes = b"", adapter: str = "",
                      lease: str | None = None) -> int:
        """Insert a verified chain of blocks into pool + prefix cache; returns how many were newly inserted.

        Hashes are checked against this engine's keys for tenant_salt/adapter
        (see shared/engine/block_transfer.py for the rules).
        """
        return self.import_chain(blocks, tenant_salt, adapter, lease).stored

    def import_chain(self, blocks: Sequence[KVBlock], tenant_salt: bytes = b"", adapter: str = "",
                     lease: str | None = None) -> ImportResult:
        """`import_blocks`, also saying how far the chain reached (`reached` leading blocks cached now).

        With `lease` (the id of the request they are for) the reached blocks, imported or already
        cached, stay referenced until that request ends or `release_lease(lease)`.
        """
        imported = import_chain(self.cache, self.kv_cache, blocks, self.hash_keys(tenant_salt, adapter), self._copier)
        if lease is None:
            self.cache.release(imported.chain)
        else:
            self.leases.adopt(lease, imported.chain)
        return ImportResult(reached=len(imported.chain), stored=imported.stored)

    def lease_cached(self, lease: str, hashes: Sequence[BlockHash]) -> int:
        """Put the leading cached run of `hashes` under `lease` (blocks a request will find in L1); how many."""
        return self.leases.hold_cached(lease, hashes)

    def cached_prompt_views(self, request_id: str, start: int, lease: str) -> list[KVBlock]:
        """The running request's full prompt blocks cached since block `start`, as `lease_views` under
        `lease`. Empty once the request has ended."""
        req = self._requests.get(request_id)
        if req is None:
            return []
        end = min(req.num_cached_blocks, req.num_prompt_tokens // self.block_size)
        return self.lease_views(req.block_hashes[start:end], lease) if end > start else []

    def lease_views(self, hashes: Sequence[BlockHash], lease: str) -> list[KVBlock]:
        """The leading cached run of `hashes` as views of the pool (no copy), held under `lease`: a cached
        block someone holds is never rewritten, so another thread may read them until `release_lease(lease)`."""
        held = self.leases.hold_cached(lease, hashes)
        views = []
        for h in hashes[:held]:
            block = self.cache.get(h)
            views.append(KVBlock(h, block.parent_hash, block.token_ids, self.kv_cache[:, :, block.block_id]))
        return views

    def release_lease(self, lease: str) -> int:
        """End a lease whose request will not be added (failed, aborted before); no-op if there is none."""
        if lease in self._requests:
            return 0  # the request owns it now: it ends with the request
        return self.leases.release(lease)
