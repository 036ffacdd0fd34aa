"""Sender-side flow control for one streamed transfer: bytes in flight stay under a window.

The receiver reports how many reply bytes it has taken in (a credit); the
sender may put a message on the wire only while sent - received + size <=
window (one message always may go when nothing is in flight, so a message
bigger than the window still moves). This bounds what a slow or stalled
receiver makes the bus buffer for it (nats-server cuts a connection whose
outbound buffer passes its `max_pending`, 64 MB by default), and a receiver
that stops crediting stalls the sender, which gives up after `stall_s`.
"""

from __future__ import annotations

import asyncio

from kvmesh.aio import wait_event


class TransferCancelled(Exception):
    """The receiver said it no longer wants the rest."""


class CreditWindow:
    __slots__ = ("window", "sent", "received", "cancelled", "_moved")

    def __init__(self, window: int) -> None:
        self.window = window
        self.sent = 0
        self.received = 0
        self.cancelled = False
        self._moved = asyncio.Event()

    async def reserve(self, size: int, stall_s: float) -> None:
        """Wait until `size` more bytes fit; TimeoutError after `stall_s` without a credit."""
        while True:
            if self.cancelled:
                raise TransferCancelled
            in_flight = self.sent - self.received
            if in_flight <= 0 or in_flight + size <= self.window:
                self.sent += size
                return
            self._moved.clear()
            if not await wait_event(self._moved, stall_s):
                raise TimeoutError(f"no credit for {stall_s}s")

    def credit(self, received: int, cancel: bool = False) -> None:
        self.received = max(self.received, received)
        self.cancelled = self.cancelled or cancel
        self._moved.set()
