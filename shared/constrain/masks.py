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

import numpy as np
import torch
from kvmesh.constrain.matcher import Matcher


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
        self._eos = np.array(sorted(eos_ids), dtype=np.int64)
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
        words = pending.bitmask.numpy()
        unconstrained = np.ones(len(words), dtype=bool)
        unconstrained[pending.rows] = False
        words[unconstrained] = -1  # rows without a matcher allow everything
        # bit j of little-endian word w is token 32 * w + j: unpacking bytes little-bit-first keeps token order
        allowed = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")[:, : logits.shape[-1]]
        stuck = ~allowed.any(axis=-1)
        if stuck.any():  # a broken matcher allows nothing: let it end (EOS) rather than sample from nothing
            allowed[np.ix_(stuck.nonzero()[0], self._eos)] = 1
        logits.masked_fill_(torch.from_numpy(allowed == 0).to(logits.device), float("-inf"))

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
