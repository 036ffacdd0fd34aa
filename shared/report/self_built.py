"""What the measured traffic costs on GPUs you run: a self-built engine with its own prefix cache, and kvmesh.

The records carry no GPU busy time (and the local stack runs on CPU), so
throughput is a stated model from the price file, printed with the result:

    prefill seconds of n tokens after a cached prefix of c
        = (FLOPs(n) - FLOPs(c)) / (peak x mfu)     FLOPs as shared/sim/recompute_model.py
    decode seconds = tokens_out / decode_tokens_per_s  (a batched rate per GPU)

Each option is the same records with a different c per request:
- self_built: what one engine's LRU prefix cache in its own L1 held (shared/report/l1_baseline.py),
  as vLLM or SGLang give for free;
- kvmesh_cross_turn: the record's cached tokens (any tier, any worker);
- no_cache: c = 0, the reference that shows what L1 prefix caching alone saves (not an option).

Busy GPU-hours are the sum over requests. A fleet is sized for its busiest
minute, so it runs at mean/peak utilization: provisioned GPU-hours = busy x
peak/mean QPS. Cost = provisioned GPU-hours x the GPU-hour price.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from kvmesh.protocol.traffic import TrafficRecord
from kvmesh.report.hosted import per_day, per_million
from kvmesh.report.measure import Measured
from kvmesh.report.prices import SelfBuiltModel
from kvmesh.sim.recompute_model import Geometry, prefill_flops


@dataclass(frozen=True, slots=True)
class SelfBuiltCost:
    option: str  # "self_built", "kvmesh_cross_turn" or the "no_cache" reference
    cached_tokens: int  # prompt tokens not prefilled
    prefill_gpu_s: float
    decode_gpu_s: float
    busy_gpu_hours: float
    provisioned_gpu_hours: float
    gpu_hour_usd: float
    total_usd: float
    per_1m_tokens_usd: float
    per_day_usd: float

    def to_json(self) -> dict:
        return asdict(self)


def geometry(model: SelfBuiltModel) -> Geometry:
    # kv_heads does not enter the FLOP count; the Geometry wants one, so it gets the q heads.
    return Geometry(model.model, model.params, model.layers, model.q_heads, model.q_heads, model.head_dim)


def prefill_s(model: SelfBuiltModel, tokens: int, cached: int) -> float:
    """GPU seconds to prefill `tokens` of prompt when the first `cached` come from a cache."""
    g = geometry(model)
    cached = min(cached, tokens)
    return (prefill_flops(g, tokens) - prefill_flops(g, cached)) / (model.peak_tflops * 1e12 * model.mfu)


def gpu_cost(option: str, records: Sequence[TrafficRecord], cached: Sequence[int], m: Measured,
             model: SelfBuiltModel, gpu_hour_usd: float | None = None) -> SelfBuiltCost:
    """The cost of serving `records` on `model`'s GPUs when request i finds its first `cached[i]` tokens cached."""
    prefill = sum(prefill_s(model, r.input_length, c) for r, c in zip(records, cached, strict=True))
    decode = m.tokens_out / model.decode_tokens_per_s
    busy = (prefill + decode) / 3600
    provisioned = busy * max(1.0, m.load.peak_to_mean)
    price = model.gpu_hour_usd if gpu_hour_usd is None else gpu_hour_usd
    total = provisioned * price
    reused = sum(min(c, r.input_length) for r, c in zip(records, cached, strict=True))
    return SelfBuiltCost(option, reused, prefill, decode, busy, provisioned, price, total,
                         per_million(total, m), per_day(total, m))


def describe(model: SelfBuiltModel, gpu_hour_usd: float | None = None) -> dict:
    """The stated model, as printed next to the self-built costs."""
    return {
        "gpu": model.gpu, "gpu_hour_usd": model.gpu_hour_usd if gpu_hour_usd is None else gpu_hour_usd,
        "model": model.model,
        "prefill": "FLOPs = 2*params*n + 4*layers*q_heads*head_dim*n^2/2; s = (FLOPs(n) - FLOPs(cached)) / (peak*mfu)",
        "params": model.params, "layers": model.layers, "q_heads": model.q_heads, "head_dim": model.head_dim,
        "peak_tflops": model.peak_tflops, "mfu": model.mfu,
        "decode_tokens_per_s": model.decode_tokens_per_s,
        "provisioning": "provisioned GPU-hours = busy GPU-hours x peak/mean QPS (sized for the busiest minute)",
        "measured": False,
    }
