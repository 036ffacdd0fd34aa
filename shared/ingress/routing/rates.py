"""Each prefill worker's measured prefill rate (seconds per uncached token), as an EWMA.

The ingress measures it itself: from publishing a PrefillJob to its seq-0
event (what the client sees as TTFT on that worker), divided by the tokens
the worker had to compute (prompt - cached, as seq 0 reports). That time
includes the worker's queue, which is the point: a slow or busy worker
looks slow. Short prefills are no sample (fixed per-request overhead
would dominate). A worker never observed is assumed as fast as the mean of
the observed ones (workers are alike by default), else `prior_s_per_token`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class PrefillRates:
    prior_s_per_token: float = 2e-4
    alpha: float = 0.2  # weight of the newest observation
    min_tokens: int = 64  # shorter prefills are dominated by fixed overhead: not a rate sample
    _rates: dict[str, float] = field(default_factory=dict)
    _mean: float | None = None  # of `_rates`, kept on every change: `rate` runs once per worker per routing pick

    def observe(self, worker: str, seconds: float, uncached_tokens: int) -> None:
        if uncached_tokens < self.min_tokens or seconds <= 0:
            return
        sample = seconds / uncached_tokens
        old = self._rates.get(worker)
        self._rates[worker] = sample if old is None else old + self.alpha * (sample - old)
        self._mean = None

    def rate(self, worker: str) -> float:
        rate = self._rates.get(worker)
        if rate is not None:
            return rate
        if not self._rates:
            return self.prior_s_per_token
        if self._mean is None:
            self._mean = sum(self._rates.values()) / len(self._rates)
        return self._mean

    def forget(self, keep: set[str]) -> None:
        """Drop the rates of workers no longer live (a restarted id starts from the prior again)."""
        gone = self._rates.keys() - keep
        for worker in gone:
            del self._rates[worker]
        if gone:
            self._mean = None
