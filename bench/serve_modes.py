"""The stacks `kvmesh bench serve` runs side by side: kvmesh, the engines' own prefix cache alone, no cache.

- `kvmesh`: the stack as `kvmesh up` runs it: cache-aware prefill routing
  (`cost`, asking the cache index), L2, L3 (unless `--no-l3`), session
  retention and the session-aware L1 policy.
- `l1_only`: what a user gets from vLLM or SGLang behind a plain load
  balancer, for free: each engine's automatic prefix cache in its own
  pool (L1), evicted LRU, and nothing else. Prefill is routed round-robin
  (no cache-index lookup), L2 has 0 bytes (the workers keep the tier, which
  then refuses every block: the prefill and decode paths treat a refused
  block like any other miss), no L3, no session retention. Two more
  switches only take away work that has no use without L2: the eviction
  service's watermark advice (`high_water` 1.0: it never demotes from L1,
  there is nowhere to demote to) and the probes of same-host peers' L2.
- `cache_off`: no prefix cache at all, no L3: the reference row.

Everything else (workers, model, each engine's pool size, ingress, the
prompt builder that splices an answer's generated ids back into the next
turn) is the same in every mode, so each mode serves the same prompts and, greedy, should give the
same answers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

KVMESH = "kvmesh"
L1_ONLY = "l1_only"
CACHE_OFF = "cache_off"

L1_ONLY_ENV: Mapping[str, str] = MappingProxyType({
    "KVMESH_INGRESS__ROUTING": "round_robin",
    "KVMESH_TIERS__L2_CAPACITY_BYTES": "0",
    "KVMESH_TIERS__L3_ENABLED": "false",
    "KVMESH_EVICTION__SESSIONS__ENABLED": "false",
    "KVMESH_ENGINE__EVICTION_POLICY": "lru",
    "KVMESH_EVICTION__HIGH_WATER": "1.0",
    "KVMESH_WORKERS__PROBE_PEERS": "false",
})


@dataclass(frozen=True, slots=True)
class ServeMode:
    name: str
    cache: bool  # the engines' prefix caching (`running_stack`'s switch; off also turns L3 off)
    env: Mapping[str, str] = field(default_factory=dict)  # settings on top of `running_stack`'s, for every service


def serve_modes() -> tuple[ServeMode, ...]:
    """The three modes, in the order they run."""
    return ServeMode(KVMESH, True), ServeMode(L1_ONLY, True, L1_ONLY_ENV), ServeMode(CACHE_OFF, False)
