"""Where a request decodes: on its prefill worker, or handed off to a decode worker.

A handoff moves every full block of the prompt's KV to another worker before
the second token. What it buys is the decode's compute off the prefill
worker: its decode steps no longer share a batch with the prompts queued
behind it. `decode_placement` (IngressSettings):

- "split": always hand off (a fleet whose decode pool is sized for it);
- "priced": decode on the prefill worker unless the handoff pays, in
  seconds, like the prefill router (cost.py):

      handoff_s = prompt blocks x handoff_s_per_block        (the KV moved before token 2)
      freed_s   = decode tokens x decode_s_per_token x requests queued on the prefill worker
                                                        (what its decode steps would cost them)

  Decode here when handoff_s >= freed_s (little decode work, or an idle
  prefill worker), when the decode worker is busier than the prefill
  worker, when there is no live decode worker, or when both share a host:
  then the decode worker computes on the same cores, so a handoff frees
  nothing and only moves bytes (`kvmesh up`, one box, runs "priced");
- "local": always decode on the prefill worker (Helm's fleet of vLLM workers,
  `engine.backend = "vllm"`: a vLLM decode worker reads a handoff's KV from
  the prefill worker's shared memory, so the chart runs none).

Migration is unchanged: a request decoding on its prefill worker that goes
silent moves to a decode worker like any other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from kvmesh.config import IngressSettings
from kvmesh.ingress.routing.workers import WorkerView

DecodePlacement = Literal["split", "priced", "local"]


@dataclass(frozen=True, slots=True)
class PlacementCosts:
    mode: DecodePlacement = "split"
    handoff_s_per_block: float = 5e-3  # a block's KV from the prefill worker into the decode worker's pool
    decode_s_per_token: float = 0.02  # one decode step's share of a batch, as felt by a queued prefill

    @classmethod
    def of(cls, s: IngressSettings) -> PlacementCosts:
        return cls(s.decode_placement, s.handoff_s_per_block, s.decode_s_per_token)


def host_of(view: WorkerView) -> str | None:
    """The host a worker's side server listens on (its heartbeat's endpoint): workers on one host share its cores."""
    return urlsplit(view.heartbeat.http_endpoint).hostname


def decode_here(costs: PlacementCosts, prefill: WorkerView | None, decode: WorkerView | None,
                prompt_tokens: int, max_tokens: int, block_size: int) -> bool:
    """Whether the request should decode on its prefill worker (see the module docstring for the rule)."""
    if costs.mode == "split" or prefill is None:
        return False
    if costs.mode == "local":
        return True
    if decode is None or host_of(prefill) == host_of(decode):
        return True
    if decode.score() > prefill.score():
        return True
    handoff_s = (prompt_tokens // block_size) * costs.handoff_s_per_block
    freed_s = max(max_tokens - 1, 0) * costs.decode_s_per_token * prefill.queued()
    return handoff_s >= freed_s
