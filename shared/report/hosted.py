"""What the measured traffic would have cost on a hosted API, with its cache-read and cache-write prices.

Per API, in USD (prices per 1M tokens):

    plain input  = (tokens_in - cached - written) x input
    cache reads  = cached x cached_input
    cache writes = sum over TTLs of written[ttl] x input x write_multiplier(ttl)
    storage      = sum over TTLs of written[ttl] x ttl/3600 x storage_per_mtok_hour
    output       = tokens_out x output

Assumption, stated in every report: a hosted API's cache hits the same
`cached_tokens` kvmesh measured. Automatic caching (OpenAI, Gemini implicit,
DeepSeek) is best effort and usually hits less, so the hosted figures are a
lower bound; Anthropic needs breakpoints, which the recorded writes stand for.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvmesh.report.measure import Measured
from kvmesh.report.prices import HostedPrices

MTOK = 1_000_000
ASSUMPTION = ("each hosted API is assumed to hit the same cached tokens kvmesh measured "
              "(automatic caching is best effort: a lower bound on its cost)")


@dataclass(frozen=True, slots=True)
class HostedCost:
    provider: str
    model: str
    input_usd: float
    cache_read_usd: float
    cache_write_usd: float
    storage_usd: float
    output_usd: float
    total_usd: float
    per_1m_tokens_usd: float  # total over (tokens in + out), per million
    per_day_usd: float  # total scaled to a day of this traffic

    def to_json(self) -> dict:
        return asdict(self)


def per_million(total_usd: float, m: Measured) -> float:
    tokens = m.tokens_in + m.tokens_out
    return total_usd / tokens * MTOK if tokens else 0.0


def per_day(total_usd: float, m: Measured) -> float:
    return total_usd / m.days if m.days else 0.0


def hosted_cost(m: Measured, p: HostedPrices) -> HostedCost:
    """The cost of `m` on API `p` (see the module docstring for the formula)."""
    plain = max(0, m.tokens_in - m.cached_tokens - m.cache_write_total)
    input_usd = plain * p.input / MTOK
    read_usd = m.cached_tokens * p.cached_input / MTOK
    write_usd = sum(n * p.input * p.write_multiplier(ttl) for ttl, n in m.cache_write_tokens.items()) / MTOK
    storage_usd = sum(n * ttl / 3600 * p.storage_per_mtok_hour for ttl, n in m.cache_write_tokens.items()) / MTOK
    output_usd = m.tokens_out * p.output / MTOK
    total = input_usd + read_usd + write_usd + storage_usd + output_usd
    return HostedCost(p.provider, p.model, input_usd, read_usd, write_usd, storage_usd, output_usd, total,
                      per_million(total, m), per_day(total, m))
