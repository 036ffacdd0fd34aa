"""A request's state inside the engine, and what the engine reports back.

`Request.token_ids` is prompt + output so far; `num_computed` of them have
K/V in the pool (in `blocks`). `block_hashes` are the chained hashes of the
full blocks of `token_ids`, extended only when a block fills.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch
from kvmesh.engine.block_pool import Block
from kvmesh.engine.detokenizer import IncrementalDetokenizer
from kvmesh.engine.sampling import SamplingParams
from kvmesh.protocol.block_hash import BlockHash, HashKeys, hash_block, hash_blocks

if TYPE_CHECKING:
    from kvmesh.constrain.matcher import Matcher

FinishReason = Literal["stop", "length", "abort"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    token_ids: list[int]  # all output tokens so far
    text_delta: str
    text: str
    finished: bool
    finish_reason: FinishReason | None
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from the cache when first scheduled
    arrival_time: float  # time.monotonic() at add_request
    first_token_time: float | None
    finished_time: float | None = None

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first output token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    keys: HashKeys
    block_size: int
    arrival_time: float
    generator: torch.Generator | None = None
    detokenizer: IncrementalDetokenizer | None = None
    status: RequestStatus = RequestStatus.WAITING
    num_computed: int = 0
    blocks: list[Block] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks that are in the prefix cache (hit or stored)
    cached_tokens: int | None = None
    first_token_time: float | None = None
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    use_cache: bool = True  # False: never attach cached blocks (a cold recompute, e.g. the cache audit)
    matcher: Matcher | None = None  # a constrained request's grammar state (shared/engine/constraints.py)

    def __post_init__(self) -> None:
        self.block_hashes = hash_blocks(self.token_ids, self.block_size, self.keys)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def append_token(self, token_id: int) -> None:
        """Add one generated token; hashes the block it completes, if any."""
        self.token_ids.append(token_id)
        n = len(self.token_ids)
        if n % self.block_size == 0:
            parent = self.block_hashes[-1] if self.block_hashes else None
            self.block_hashes.append(hash_block(parent, self.token_ids[n - self.block_size :], self.keys))

    def block_tokens(self, index: int) -> tuple[int, ...]:
        bs = self.block_size
        return tuple(self.token_ids[index * bs : (index + 1) * bs])
