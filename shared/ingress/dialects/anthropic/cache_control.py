"""Anthropic `cache_control` breakpoints: validation, token positions, pins and usage arithmetic.

A breakpoint marks "cache the prompt up to and including this block" for a
TTL (`5m` or `1h`). Rules (Anthropic's): at most 4 per request, and a `1h`
one may not follow a `5m` one (longer TTLs first). Its position is the
number of leading prompt tokens that lie inside the rendered text up to the
marked block: the conversation cut after that block is rendered without a
generation prompt, its common text prefix with the full rendering is where
the block ends, and `PromptBuilder.prefix_length` counts the piecewise ids
inside it (exact, never past the block). Each breakpoint becomes a
`CachePin(num_tokens, ttl)` for the workers.

Usage: `cache_read_input_tokens` = the cached prefix; the tokens from there
up to the last breakpoint were written to the cache (`cache_creation`),
each counted under the TTL of the first breakpoint at or after it;
`input_tokens` = the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from kvmesh.ingress.core.errors import invalid
from kvmesh.ingress.core.prompt import PromptBuilder
from kvmesh.protocol.serving import CachePin

Ttl = Literal["5m", "1h"]
TTL_SECONDS: dict[str, float] = {"5m": 300.0, "1h": 3600.0}
MAX_BREAKPOINTS = 4


@dataclass(slots=True)
class Conversation:
    """Role/content dicts and tool schemas, as the chat template takes them."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None


@dataclass(frozen=True, slots=True)
class Breakpoint:
    """A marked block: its TTL and the conversation up to and including it."""

    ttl: Ttl
    cut: Conversation


@dataclass(frozen=True, slots=True)
class Placed:
    """A breakpoint at its token position in the prompt."""

    num_tokens: int
    ttl: Ttl

    def pin(self) -> CachePin:
        return CachePin(num_tokens=self.num_tokens, ttl_s=TTL_SECONDS[self.ttl])


@dataclass(frozen=True, slots=True)
class CacheUsage:
    """Anthropic's usage fields for the prompt side of a response."""

    input_tokens: int
    cache_read_input_tokens: int
    ephemeral_5m_input_tokens: int
    ephemeral_1h_input_tokens: int

    @property
    def cache_creation_input_tokens(self) -> int:
        return self.ephemeral_5m_input_tokens + self.ephemeral_1h_input_tokens

    def to_dict(self, output_tokens: int) -> dict[str, Any]:
        return {
            "input_tokens": self.input_tokens,
            "cache_creation_input_tokens": self.cache_creation_input_tokens,
            "cache_read_input_tokens": self.cache_read_input_tokens,
            "cache_creation": {"ephemeral_5m_input_tokens": self.ephemeral_5m_input_tokens,
                               "ephemeral_1h_input_tokens": self.ephemeral_1h_input_tokens},
            "output_tokens": output_tokens,
        }


def check_breakpoints(breakpoints: list[Breakpoint]) -> None:
    """400 (invalid_request_error) for more than 4 breakpoints or a 1h one after a 5m one."""
    if len(breakpoints) > MAX_BREAKPOINTS:
        raise invalid(f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. "
                      f"Found {len(breakpoints)}.", param="cache_control")
    seen_short = False
    for bp in breakpoints:
        if bp.ttl == "5m":
            seen_short = True
        elif seen_short:
            raise invalid("a ttl='1h' cache_control block must not come after a ttl='5m' one "
                          "(tools, then system, then messages)", param="cache_control")


def _common_prefix(a: str, b: str) -> int:
    """Length of the common prefix; bisects with C-level slice compares (prompts may be megabytes)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def place(prompts: PromptBuilder, tenant: str, conv: Conversation, rendered: str, ids: list[int],
          breakpoints: list[Breakpoint]) -> list[Placed]:
    """Token positions of `breakpoints` in `ids` (the piecewise tokens of `rendered`, the full prompt)."""
    placed = []
    for bp in breakpoints:
        cut = prompts.render(bp.cut.messages, bp.cut.tools, generation_prompt=False)
        end = _common_prefix(cut, rendered)
        placed.append(Placed(prompts.prefix_length(tenant, ids, rendered, conv.messages, end), bp.ttl))
    return placed


def pins(placed: list[Placed]) -> list[CachePin]:
    return [p.pin() for p in placed if p.num_tokens > 0]


def cache_usage(prompt_tokens: int, cached_tokens: int, placed: list[Placed]) -> CacheUsage:
    """Split the prompt into read / created (by TTL) / plain input tokens; see the module docstring."""
    created = {"5m": 0, "1h": 0}
    covered = cached_tokens  # tokens before this are accounted for
    for p in sorted(placed, key=lambda p: p.num_tokens):
        end = min(p.num_tokens, prompt_tokens)
        if end > covered:
            created[p.ttl] += end - covered
            covered = end
    rest = prompt_tokens - cached_tokens - created["5m"] - created["1h"]
    return CacheUsage(max(0, rest), cached_tokens, created["5m"], created["1h"])
