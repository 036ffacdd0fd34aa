"""`KVMeshConnector`: kvmesh's tiers behind vLLM's own prefix cache, through vLLM's KV-connector interface.

Load it into vLLM 0.32 (CPU build) with

    --kv-transfer-config '{"kv_connector": "KVMeshConnector",
                           "kv_connector_module_path": "kvmesh.connectors.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}'

(or the same dict as `LLM(kv_transfer_config=...)`). vLLM keeps its pool and
its own prefix cache; kvmesh holds what the pool lets go of, in the worker's
L2 and in S3, across restarts and for other instances. The two roles run in
different processes (scheduler_side.py, worker_side.py); the scheduler's
plan for each step reaches the worker as `StepPlan`.

`kv_connector_extra_config` may set `worker_id` (the L2 slab's name; by
default derived from vLLM's engine id, which both processes share) and
`peers`, the worker ids of other vLLM instances on this host whose L2 slabs
it reads before S3, and `fleet_role`: `vllm` (a vLLM server of its own, the
default) or the kvmesh worker role it runs inside (`prefill`, `decode`:
shared/workers/vllm_backend.py), which heartbeats for it; the connector
then takes that worker's eviction commands (advice.py).
Everything else comes from kvmesh's settings (`KVMESH_*`: L2 size, S3
endpoint, bucket, credentials under the state dir).

The connector is a cache: a load vLLM was promised and the worker cannot
deliver is recomputed, so it asks for `kv_load_failure_policy: "recompute"`
and refuses to start under "fail" (every such miss would fail a request).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from kvmesh.config import load_settings
from kvmesh.connectors.vllm.advice import ConnectorAdvice
from kvmesh.connectors.vllm.plan import StepPlan
from kvmesh.connectors.vllm.scheduler_side import SchedulerSide
from kvmesh.connectors.vllm.store import StoreView, WorkerStore
from kvmesh.connectors.vllm.worker_side import WorkerSide
from kvmesh.kvconvert.vllm_cpu import check_packing
from kvmesh.log import get_logger
from kvmesh.protocol.messages import Role
from kvmesh.protocol.vllm_identity import model_fingerprint
from kvmesh.serving.pinning import L2Pins
from kvmesh.tiers.block_format import DTYPES
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

log = get_logger(__name__)
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class KVMeshConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        if transfer.kv_load_failure_policy != "recompute":
            raise ValueError('KVMeshConnector is a cache: start vLLM with kv_load_failure_policy "recompute" in '
                             "--kv-transfer-config, so a block it cannot deliver is recomputed, not a failed request")
        extra = transfer.kv_connector_extra_config or {}
        self.block_size = vllm_config.cache_config.block_size
        self.dtype = self._kv_dtype(vllm_config)
        settings = load_settings()
        worker_id = str(extra.get("worker_id") or f"vllm-{transfer.engine_id}")
        peers = [str(p) for p in extra.get("peers", ())]
        fleet_role = Role(extra.get("fleet_role") or Role.VLLM).value
        fingerprint = model_fingerprint(Path(vllm_config.model_config.model), self.dtype)
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            view = StoreView(settings, worker_id, fingerprint, self.block_size, peers)
            self.scheduler = SchedulerSide(view, fingerprint, self.block_size)
        else:
            check_packing(self._packing(vllm_config))
            def store(block_bytes: int) -> WorkerStore:
                kept = WorkerStore(settings, worker_id, fingerprint, self.block_size, block_bytes, peers, fleet_role)
                if fleet_role != Role.VLLM.value:  # a kvmesh worker's engine: it takes the worker's advice
                    pins = L2Pins.for_tier(settings.pins, kept.l2.capacity_bytes, kept.block_bytes)
                    kept.take_commands(ConnectorAdvice(kept, pins).on_message)
                return kept

            self.worker = WorkerSide(store, self.dtype, self.block_size)
        log.info("kvmesh connector ready", role=role.name, worker_id=worker_id, fingerprint=fingerprint[:12],
                 block_size=self.block_size, dtype=self.dtype)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: nothing must be delivered before a preempted request may be recomputed

    # -- worker ------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register(kv_caches)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        assert self.worker is not None
        plan = self._get_connector_metadata()
        if isinstance(plan, StepPlan) and plan.loads:  # a step with loads calls this before its forward pass
            self.worker.load(plan.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads finish in start_load_kv, before the forward pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return None  # blocks are kept whole, all layers at once, in wait_for_save

    def wait_for_save(self) -> None:
        assert self.worker is not None
        if self.worker.store is not None:
            self.worker.store.stepped()
        plan = self._get_connector_metadata()
        if isinstance(plan, StepPlan) and plan.saves:
            self.worker.keep(plan.saves)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors() if self.worker is not None else set()

    def shutdown(self) -> None:
        if self.worker is not None:
            log.info("kvmesh connector stopping", role="WORKER", loaded_blocks=self.worker.loaded_blocks,
                     kept_blocks=self.worker.kept_blocks, load_s=round(self.worker.load_s, 3),
                     keep_s=round(self.worker.keep_s, 3))
            if self.worker.store is not None:
                self.worker.store.close()
        if self.scheduler is not None:
            log.info("kvmesh connector stopping", role="SCHEDULER", lookups=self.scheduler.lookups,
                     offered_tokens=self.scheduler.offered_tokens)
            self.scheduler.view.close()

    # -- scheduler ---------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.matched(request, num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        assert self.scheduler is not None
        self.scheduler.allocated(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> StepPlan:
        assert self.scheduler is not None
        return self.scheduler.step(scheduler_output)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        self.scheduler.finished(request)
        return False, None  # kept synchronously in the step that filled each block: free them now

    # -- helpers -----------------------------------------------------------

    @staticmethod
    def _kv_dtype(vllm_config) -> str:
        cache_dtype = vllm_config.cache_config.cache_dtype
        dtype = vllm_config.model_config.dtype if cache_dtype == "auto" else getattr(torch, str(cache_dtype), None)
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"KVMeshConnector stores float32, bfloat16 or float16 KV; vLLM's is {cache_dtype}")
        return _DTYPE_NAMES[dtype]

    def _packing(self, vllm_config) -> str:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        model = vllm_config.model_config
        return _get_attn_isa(model.dtype, self.block_size, model.get_head_size(), vllm_config.cache_config.cache_dtype)
