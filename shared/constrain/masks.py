"""A step's token masks: filled from the matchers (optionally while the forward runs), applied to logits.

The grammar library fills one bit per token for all constrained rows at
once (it spreads the rows over its own threads and drops the GIL), so with
`overlap` the fill runs on a helper thread started before the model's
forward and is waited for only when the logits are there: the mask cost
hides behind the forward, as vLLM and SGLang do. Rows without a matcher are
left alone: an unconstrained request samples exactly what it would alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from shared.constrain.matcher import Matcher


@dataclass(slots=True)
class PendingMasks:
    bitmask: torch.Tensor  # int32 [rows, words]; one bit per token id
    rows: list[int]  # the rows that have a matcher
    fill: Future | None  # None: filled already


class MaskFiller:
    """Fills and applies token masks for the sampled rows of a step; one per engine."""

    def __init__(self, vocab_size: int, eos_ids: Sequence[int], overlap: bool = True) -> None:
        import llguidance

        self._executor = llguidance.LLExecutor()
        self._words = (vocab_size + 31) // 32
        self._eos = torch.tensor(sorted(eos_ids), dtype=torch.long)
        self._shifts = torch.arange(32, dtype=torch.int32)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks") if overlap else None

    def start(self, matchers: Sequence[Matcher | None]) -> PendingMasks | None:
        """Begin filling masks for rows with a matcher (None when there is none); the matchers must not move until `apply`."""
        pairs = [(m.raw, i) for i, m in enumerate(matchers) if m is not None]
        if not pairs:
            return None
        bitmask = torch.zeros((len(matchers), self._words), dtype=torch.int32)

        def fill() -> None:
            self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), self._words * 4, len(matchers))

        rows = [i for _, i in pairs]
        if self._thread is None:
            fill()
            return PendingMasks(bitmask, rows, None)
        return PendingMasks(bitmask, rows, self._thread.submit(fill))

    def apply(self, pending: PendingMasks, logits: torch.Tensor) -> None:
        """Set the logits [rows, vocab] of disallowed tokens to -inf, in place (waits for the fill)."""
        if pending.fill is not None:
            pending.fill.result()
        rows = torch.tensor(pending.rows, dtype=torch.long)
        words = pending.bitmask[rows]
        allowed = ((words.unsqueeze(-1) >> self._shifts) & 1).view(len(pending.rows), -1)[:, : logits.shape[-1]].bool()
        stuck = ~allowed.any(dim=-1)
        if bool(stuck.any()):  # a broken matcher allows nothing: let it end (EOS) rather than sample from nothing
            allowed[stuck.nonzero().squeeze(-1).unsqueeze(-1), self._eos.unsqueeze(0)] = True
        rows = rows.to(logits.device)
        logits[rows] = logits[rows].masked_fill_(~allowed.to(logits.device), float("-inf"))

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
