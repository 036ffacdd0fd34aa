"""Per-request sampling parameters and the batched sampler.

Greedy rows (temperature 0) are one argmax over the batch. Every other row
is sampled alone with the request's own `torch.Generator`, seeded from
`seed`, so a seeded request draws the same tokens whatever else shares its
batch.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvmesh.protocol.serving import SamplingSpec

MIN_TEMPERATURE = 1e-4


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k
    seed: int | None = None
    stop: tuple[str, ...] = ()  # text-level; output is cut before the stop string
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    detokenize: bool = True  # False: token ids only (no text, no stop strings), less work per token
    # A kvmesh.protocol.serving.Constraint as JSON (hashable; the grammar cache's key): the engine masks
    # every step to its grammar (shared/constrain/) and ends the request "stop" when the grammar is complete.
    constraint: str | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def of(cls, spec: SamplingSpec, max_tokens: int | None = None) -> SamplingParams:
        """The engine's parameters for a request's wire `SamplingSpec` (`max_tokens` overrides the spec's)."""
        return cls(
            max_tokens=spec.max_tokens if max_tokens is None else max_tokens,
            temperature=spec.temperature,
            top_p=spec.top_p,
            top_k=spec.top_k,
            seed=spec.seed,
            stop=tuple(spec.stop),
            stop_token_ids=tuple(spec.stop_token_ids),
            ignore_eos=spec.ignore_eos,
            constraint=None if spec.constraint is None else spec.constraint.model_dump_json(),
        )


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """The request's own RNG (None for greedy); unseeded requests get a random seed."""
    if params.greedy:
        return None
    gen = torch.Generator()
    gen.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
    return gen


def skip_draws(generator: torch.Generator | None, n: int, vocab_size: int) -> None:
    """Advance a request's RNG past `n` tokens sampled elsewhere (a resumed request), as if drawn here.

    `sample_row` draws through torch.multinomial(probs, 1), which takes one exponential per vocab
    entry; the serving tests check that a resumed seeded request draws what the whole run draws.
    """
    if generator is None:
        return
    scratch = torch.empty(vocab_size)
    for _ in range(n):
        scratch.exponential_(1, generator=generator)


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Set all but the k largest logits of the last dim to -inf (k <= 0 or >= vocab: unchanged)."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of top tokens whose probability reaches p; the top token always stays."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly better tokens
    drop_sorted = before >= p
    drop_sorted[..., 0] = False  # also when p rounds to 0 in the logits' dtype (a subnormal top_p)
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from one row of logits [vocab] under `params`."""
    if params.greedy:
        return int(torch.argmax(logits))
    # a temperature near 0 would scale logits to inf (nan probabilities); below MIN_TEMPERATURE it is as sharp
    scaled = logits.float() / max(params.temperature, MIN_TEMPERATURE)
    scaled = apply_top_p(apply_top_k(scaled, params.top_k), params.top_p)
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """One token per row of logits [S, vocab]."""
    out = torch.argmax(logits, dim=-1).tolist()
    for i, p in enumerate(params):
        if not p.greedy:
            out[i] = sample_row(logits[i], p, generators[i])
    return out
