"""The serving messages: ingress -> prefill -> decode -> ingress.

    ingress --PrefillJob--> kvmesh.jobs.prefill.<worker>      (JetStream, msg id = request_id:attempt)
    prefill --TokenEvent(seq 0: first token)--> kvmesh.tokens.<request>
    prefill --DecodeJob(handles + first token)--> kvmesh.handoff.<decode worker>
    decode  --TokenEvent(seq 1..n)--> kvmesh.tokens.<request>
    ingress --DecodeJob(migration: prompt + tokens so far)--> kvmesh.jobs.decode.<worker>
    ingress --AbortRequest (client gone: all attempts;
                            migration: the replaced attempt)--> kvmesh.abort.<worker>   (core NATS, best effort)

`seq` numbers the generated tokens of a request from 0; the ingress drops
what it has already seen, so a retried prefill or a migrated decode can
resend tokens without the client seeing duplicates. The ingress takes
events only from the request's current attempt: a replaced attempt that
still runs (a paused worker resumed) is fenced off, whatever its seq. Every
handler is idempotent on (request_id, attempt).
"""

from __future__ import annotations

from typing import Any, Literal

from kvmesh.protocol.base import Message
from kvmesh.protocol.blocks import BlockHandle
from pydantic import Field


class ToolSchema(Message):
    """A function the model may call: its name and the JSON schema of its arguments."""

    name: str = Field(min_length=1)
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})


class Constraint(Message):
    """What the sampled output must be; a worker compiles it to a grammar and masks every step (shared/constrain/).

    `json`: one JSON value matching `json_schema` (None: any JSON object, OpenAI's `json_object`).
    `tool_calls`: one or more (`parallel`) calls of `tools`, in the model's own tool-call syntax
    `tool_format` (a name in shared/toolcalls/formats.py), and nothing else.
    """

    kind: Literal["json", "tool_calls"]
    json_schema: dict[str, Any] | None = None
    tools: list[ToolSchema] = Field(default_factory=list)
    tool_format: str = ""
    parallel: bool = True


class SamplingSpec(Message):
    max_tokens: int = Field(ge=1)
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    constraint: Constraint | None = None  # grammar-constrained decoding (tool_choice, response_format)


class CachePin(Message):
    """Keep the prefix of the first `num_tokens` prompt tokens for `ttl_s` (cache_control, named caches)."""

    num_tokens: int = Field(ge=0)
    ttl_s: float = Field(gt=0.0)


class PrefillJob(Message):
    # 2: `prefix_worker`; 3: `sampling.constraint`; 4: `l3_blocks` (a new field is a new wire format:
    # strict parsing rejects fields it does not know)
    SCHEMA_VERSION = 4

    request_id: str = Field(min_length=1)
    attempt: int = Field(default=0, ge=0)
    session_id: str | None = None
    tenant: str
    tenant_salt: str  # hex; derived by the ingress from the authenticated tenant, never from the client
    prompt_ids: list[int] = Field(min_length=1)
    sampling: SamplingSpec
    decode_worker: str  # where the handoff goes
    pins: list[CachePin] = Field(default_factory=list)
    prefill_only: bool = False  # named-cache creation: compute, store (L2 + L3), report, no decode
    deadline: float  # unix seconds; past it the job is dropped with a retriable error event
    # Another worker whose L1/L2 holds a longer leading run of the prompt than this one (cache index,
    # at routing): prefill fetches the missing blocks from it over the network peer path.
    prefix_worker: str | None = None
    # How many leading blocks of the prompt's chain L3 holds, per the ready cache index the ingress asked
    # at routing (None: it had no ready answer). Prefill uses it instead of asking the index again.
    l3_blocks: int | None = Field(default=None, ge=0)


class DecodeJob(Message):
    """The prefill -> decode handoff, and the ingress's migration of a request to another decode worker."""

    SCHEMA_VERSION = 2  # 2: `sampling.constraint`

    request_id: str = Field(min_length=1)
    attempt: int = Field(default=0, ge=0)
    session_id: str | None = None
    tenant: str
    tenant_salt: str
    prompt_ids: list[int] = Field(min_length=1)  # the original prompt
    generated: list[int] = Field(default_factory=list)  # tokens already delivered (first token, or all so far on migration)
    sampling: SamplingSpec  # max_tokens counts from the original prompt, including `generated`
    handles: list[BlockHandle] = Field(default_factory=list)  # full prompt blocks, in chain order
    prompt_tokens: int = Field(ge=1)
    cached_tokens: int = Field(default=0, ge=0)  # prompt tokens the prefill did not compute
    deadline: float
    cache_created_tokens: int = Field(default=0, ge=0)  # reported on the final TokenEvent (pins written by prefill)


class TokenEvent(Message):
    """One step of a request's output stream; `seq` of the first token in `token_ids`."""

    SCHEMA_VERSION = 2  # 2: `tier_tokens`

    request_id: str
    attempt: int = 0
    seq: int = Field(ge=0)
    token_ids: list[int] = Field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cache_created_tokens: int = 0  # prompt tokens newly written under a pin (cache_control / named cache)
    tier_tokens: dict[str, int] | None = None  # where cached_tokens came from: l1/l2/peer/l3 (prefill's events)
    worker_id: str = ""
    error: str | None = None
    retriable: bool = True


class AbortRequest(Message):
    """Stop `request_id`, free its sequence and publish nothing more for it.

    `attempt` None: every attempt (the client went away). An int: that attempt and older ones only (the
    ingress migrated the request to a newer attempt); a later attempt still runs here if it comes.
    """

    SCHEMA_VERSION = 2  # 2: `attempt`

    request_id: str = Field(min_length=1)
    attempt: int | None = Field(default=None, ge=0)
    reason: str = "client disconnected"
