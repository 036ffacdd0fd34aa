"""The cache audit: recompute a sample of cache-hit requests cold and compare token by token.

A cache that changes answers is a bug (DESIGN.md, cache transparency). With
`audit_rate` r, each finished greedy request that reused cached KV is
audited with probability r: the same prompt and sampling run again as a
background request of the engine (admitted only when it is idle) with the
cache bypassed, and the cold output must equal what the client got.
Counted in `kvmesh_cache_audit_total` / `kvmesh_cache_audit_mismatch_total`;
a mismatch is logged with the request id and the first differing position.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

from kvmesh.engine.sampling import SamplingParams
from kvmesh.log import get_logger
from kvmesh.serving.engine_loop import EngineLoop, RequestSpec
from prometheus_client import CollectorRegistry, Counter

log = get_logger(__name__)


@dataclass(slots=True)
class AuditCase:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    tenant_salt: bytes
    expected: list[int]  # every output token the client got, in order


@dataclass
class CacheAudit:
    engine: EngineLoop
    rate: float
    registry: CollectorRegistry
    max_pending: int = 64  # audits waiting for an idle engine; more are skipped, never queued without bound
    rng: random.Random = field(default_factory=random.Random)  # sampling only; nothing served depends on it
    _tasks: set[asyncio.Task] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.total = Counter("kvmesh_cache_audit", "Cache-hit requests recomputed cold and compared.",
                             registry=self.registry)
        self.mismatches = Counter("kvmesh_cache_audit_mismatch", "Audited requests whose cold output differed.",
                                  registry=self.registry)

    def consider(self, case: AuditCase, cached_tokens: int) -> bool:
        """Maybe audit a finished request; True when an audit was started."""
        if self.rate <= 0 or cached_tokens <= 0 or not case.params.greedy or len(self._tasks) >= self.max_pending:
            return False
        if self.rng.random() >= self.rate:
            return False
        task = asyncio.get_running_loop().create_task(self._audit(case))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    async def _audit(self, case: AuditCase) -> None:
        spec = RequestSpec(f"audit:{case.request_id}", case.prompt_ids, case.params, case.tenant_salt, use_cache=False)
        try:
            out = await self.engine.run_request(spec, lambda _: None, background=True)
        except Exception as exc:  # noqa: BLE001 - an audit that cannot run is not a mismatch
            log.warning("cache audit could not run", request_id=case.request_id, error=repr(exc))
            return
        self.total.inc()
        if out.token_ids != case.expected:
            self.mismatches.inc()
            at = next((i for i, (a, b) in enumerate(zip(out.token_ids, case.expected)) if a != b),
                      min(len(out.token_ids), len(case.expected)))
            log.error("cache audit mismatch", request_id=case.request_id, position=at,
                      served=case.expected[at:at + 8], cold=out.token_ids[at:at + 8])

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
