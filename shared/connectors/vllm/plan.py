"""What the scheduler's connector tells the worker's, every step: blocks to load, blocks to keep.

vLLM pickles this (`KVConnectorMetadata`) from the scheduler's process to the
worker's. Positions count blocks from the start of the request's tokens;
`hashes` is the chain from position 0, since L3 chunks are keyed by position.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass(slots=True)
class LoadPlan:
    """Fill vLLM blocks `block_ids` with the chain's positions `first`.. (through the end of `hashes`)."""

    request_id: str
    salt_hex: str
    hashes: list[bytes]
    first: int
    block_ids: list[int]
    peers: tuple[str, ...] = ()  # same-host workers the request named (request_peers.py)


@dataclass(slots=True)
class SavePlan:
    """Keep positions `first`.. of the chain, whose KV vLLM has in `block_ids` once this step ran."""

    request_id: str
    salt_hex: str
    hashes: list[bytes]
    first: int
    block_ids: list[int]
    token_ids: list[tuple[int, ...]]  # per kept block


@dataclass
class StepPlan(KVConnectorMetadata):
    loads: list[LoadPlan] = field(default_factory=list)
    saves: list[SavePlan] = field(default_factory=list)
