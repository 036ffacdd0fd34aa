"""The price file: hosted APIs' token prices and cache multipliers, the self-built GPU model, the rule thresholds.

The shipped file (shared/report/prices.yaml) is dated and says which numbers
were confirmed and which were not; `--prices FILE` replaces it whole. A
malformed file is a `PriceFileError` naming the key, never a silent default.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

DEFAULT_PRICES = Path(__file__).with_name("prices.yaml")


class PriceFileError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class HostedPrices:
    """One hosted API, USD per 1M tokens; `cache_write` maps a TTL (s) to a multiplier of `input`."""

    provider: str
    model: str
    source: str
    input: float
    cached_input: float
    output: float
    cache_write: dict[int, float] = field(default_factory=dict)
    storage_per_mtok_hour: float = 0.0
    caching: str = ""
    unconfirmed: tuple[str, ...] = ()

    def write_multiplier(self, ttl_s: int) -> float:
        """The multiplier of the shortest listed TTL that covers `ttl_s` (past the longest: the longest's);
        1.0 when the API lists none (a write is billed as plain input)."""
        if not self.cache_write:
            return 1.0
        covering = [t for t in self.cache_write if t >= ttl_s]
        return self.cache_write[min(covering) if covering else max(self.cache_write)]


@dataclass(frozen=True, slots=True)
class SelfBuiltModel:
    """The stated GPU model: prefill by FLOPs (shared/sim/recompute_model.py), decode at a batched rate."""

    gpu: str
    gpu_hour_usd: float
    model: str
    params: float
    layers: int
    q_heads: int
    head_dim: int
    peak_tflops: float
    mfu: float
    decode_tokens_per_s: float


@dataclass(frozen=True, slots=True)
class Rules:
    volatile_peak_to_mean: float
    hosted_ttft_ms: float
    small_volume_requests_per_day: float
    self_built_requests_per_day: float
    session_turns: float
    shared_instances: int
    cross_instance_hit_share: float


@dataclass(frozen=True, slots=True)
class PriceBook:
    as_of: str
    hosted: tuple[HostedPrices, ...]
    self_built: SelfBuiltModel
    rules: Rules
    path: str = ""


def _number(section: dict, key: str, where: str) -> float:
    value = section.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise PriceFileError(f"{where}.{key}: wants a number >= 0, got {value!r}")
    return float(value)


def _hosted(name: str, s: dict) -> HostedPrices:
    where = f"hosted.{name}"
    writes = s.get("cache_write") or {}
    if not isinstance(writes, dict):
        raise PriceFileError(f"{where}.cache_write: wants a map of TTL seconds -> multiplier")
    return HostedPrices(
        provider=name, model=str(s.get("model", "")), source=str(s.get("source", "")),
        input=_number(s, "input", where), cached_input=_number(s, "cached_input", where),
        output=_number(s, "output", where),
        cache_write={int(t): _number(writes, t, f"{where}.cache_write") for t in writes},
        storage_per_mtok_hour=_number(s, "storage_per_mtok_hour", where) if "storage_per_mtok_hour" in s else 0.0,
        caching=str(s.get("caching", "")).strip(), unconfirmed=tuple(str(u) for u in s.get("unconfirmed") or ()),
    )


def parse_prices(data: dict, path: str = "") -> PriceBook:
    """A price book from the parsed YAML mapping."""
    if not isinstance(data, dict) or not isinstance(data.get("hosted"), dict) or not data["hosted"]:
        raise PriceFileError("the price file wants a non-empty `hosted:` map")
    sb, rules = data.get("self_built"), data.get("rules")
    if not isinstance(sb, dict) or not isinstance(rules, dict):
        raise PriceFileError("the price file wants `self_built:` and `rules:` sections")
    model = SelfBuiltModel(
        gpu=str(sb.get("gpu", "")), gpu_hour_usd=_number(sb, "gpu_hour_usd", "self_built"),
        model=str(sb.get("model", "")), params=_number(sb, "params", "self_built"),
        layers=int(_number(sb, "layers", "self_built")), q_heads=int(_number(sb, "q_heads", "self_built")),
        head_dim=int(_number(sb, "head_dim", "self_built")), peak_tflops=_number(sb, "peak_tflops", "self_built"),
        mfu=_number(sb, "mfu", "self_built"), decode_tokens_per_s=_number(sb, "decode_tokens_per_s", "self_built"),
    )
    if model.mfu <= 0 or model.peak_tflops <= 0 or model.decode_tokens_per_s <= 0:
        raise PriceFileError("self_built: mfu, peak_tflops and decode_tokens_per_s must be > 0")
    values = {f.name: _number(rules, f.name, "rules") for f in fields(Rules)}
    thresholds = Rules(**{**values, "shared_instances": int(values["shared_instances"])})
    hosted = tuple(_hosted(name, section) for name, section in data["hosted"].items())
    return PriceBook(str(data.get("as_of", "")), hosted, model, thresholds, path)


def load_prices(path: Path | None = None) -> PriceBook:
    """Read a price file (default: the shipped, dated one)."""
    target = path or DEFAULT_PRICES
    try:
        data = yaml.safe_load(target.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise PriceFileError(f"{target}: {exc}") from None
    return parse_prices(data, str(target))
