"""The connector in vLLM's worker: load planned blocks into the paged KV before the forward pass, keep new ones after.

A load fetches each block from the worker's L2, then the L2 slabs of its
same-host peers (configured, or named by the request), then L3 (verified: checksum,
fingerprint, and the chain hash the plan names), converts it to vLLM's page
packing and writes it into every layer's cache at the planned block ids. The
first block it cannot fetch, and every block after it, is a load error: vLLM
truncates the request's hit there and recomputes.

After the forward pass (`wait_for_save`), the blocks each request filled in
this step are read out of the cache, converted to kvmesh's NHD layout, and
kept: L2 at once, L3 by the store's upload queue.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from kvmesh.connectors.vllm.plan import LoadPlan, SavePlan
from kvmesh.connectors.vllm.store import WorkerStore
from kvmesh.engine.kv_block import KVBlock
from kvmesh.kvconvert.errors import IncompatibleKV
from kvmesh.kvconvert.transform import convert_dtype, convert_layout
from kvmesh.kvconvert.vllm_cpu import blocks_to_pages, pages_to_blocks
from kvmesh.log import get_logger
from kvmesh.tiers.block_format import StoredBlock

log = get_logger(__name__)
_LAYER = re.compile(r"\.(\d+)\.")


def layer_order(names) -> list[str]:
    """vLLM's layer names in model order (by the first number in each name)."""
    def index(name: str) -> int:
        m = _LAYER.search(name)
        return int(m.group(1)) if m else -1
    return sorted(names, key=index)


@dataclass
class WorkerSide:
    store_factory: Callable[[int], WorkerStore]  # block bytes -> the store, built once the KV geometry is known
    dtype: str
    block_size: int
    store: WorkerStore | None = None
    layers: list[torch.Tensor] = field(default_factory=list)
    load_errors: set[int] = field(default_factory=set)
    loaded_blocks: int = 0
    kept_blocks: int = 0
    load_s: float = 0.0  # time vLLM's steps spent in load() and keep(): what the connector adds to them
    keep_s: float = 0.0

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.layers = [kv_caches[name] for name in layer_order(kv_caches)]
        _, heads, size, width = self.layers[0].shape
        if size != self.block_size:
            raise IncompatibleKV(f"vLLM's KV blocks hold {size} tokens, the connector was told {self.block_size}")
        block_bytes = len(self.layers) * heads * size * width * self.layers[0].element_size()
        self.store = self.store_factory(block_bytes)

    def load(self, plans: list[LoadPlan]) -> None:
        self.load_s += _timed(self._load, plans)

    def keep(self, plans: list[SavePlan]) -> None:
        self.keep_s += _timed(self._keep, plans)

    def _load(self, plans: list[LoadPlan]) -> None:
        for plan in plans:
            blocks, tiers = self._fetch(plan)
            short = len(blocks) < len(plan.block_ids)  # the rest is recomputed
            (log.warning if short else log.info)("kv loaded", request_id=plan.request_id, planned=len(plan.block_ids),
                                                 loaded=len(blocks), tiers={t.value: n for t, n in tiers.items() if n})
            if blocks:
                ids = torch.tensor(plan.block_ids[:len(blocks)], dtype=torch.long)
                pages = blocks_to_pages(torch.stack([b.data for b in blocks]))
                for cache, page in zip(self.layers, pages, strict=True):
                    cache.index_copy_(0, ids, page)
                self.loaded_blocks += len(blocks)
            if short:
                self.load_errors.update(plan.block_ids[len(blocks):])

    def _keep(self, plans: list[SavePlan]) -> None:
        assert self.store is not None
        for plan in plans:
            # only blocks L2 lacks leave vLLM's cache (one just loaded from L2 is there already)
            with self.store.l2_lock:
                todo = [i for i in range(len(plan.block_ids)) if plan.hashes[plan.first + i] not in self.store.l2]
            blocks: dict[bytes, KVBlock] = {}
            if todo:
                ids = torch.tensor([plan.block_ids[i] for i in todo], dtype=torch.long)
                data = pages_to_blocks([cache.index_select(0, ids) for cache in self.layers])
                for row, i in enumerate(todo):
                    pos = plan.first + i
                    parent = plan.hashes[pos - 1] if pos else None
                    blocks[plan.hashes[pos]] = KVBlock(plan.hashes[pos], parent, plan.token_ids[i], data[row])
            self.kept_blocks += self.store.keep(plan.salt_hex, plan.hashes, blocks)

    def take_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors

    def _fetch(self, plan: LoadPlan) -> tuple[list[StoredBlock], Counter]:
        """The plan's blocks converted for vLLM, as far as they are found in order; the tiers they came from."""
        assert self.store is not None
        found, tiers = self.store.fetch(plan.salt_hex, plan.hashes, plan.first, plan.peers)
        usable: list[StoredBlock] = []
        for block in found[:len(plan.block_ids)]:
            try:
                usable.append(convert_dtype(convert_layout(block, "NHD"), self.dtype))
            except IncompatibleKV as exc:
                log.warning("kv block not loadable", request_id=plan.request_id, error=str(exc))
                break
        return usable, tiers


def _timed(step: Callable[[list], None], plans: list) -> float:
    """Seconds `step(plans)` took."""
    t0 = time.perf_counter()
    step(plans)
    return time.perf_counter() - t0
