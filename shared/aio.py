"""Timed waits that never swallow a cancel.

On Python 3.11, `asyncio.wait_for` returns the awaited result when a cancel reaches it in the
same loop turn that the result arrives: the cancel is lost, and a loop stopped by
`task.cancel()` goes on running (its owner then waits for it forever). A KV watcher fed by
heartbeats, or an event set while its waiter is cancelled, hits this often enough under load.
`asyncio.timeout` does not lose cancels, so long-lived loops wait through these helpers.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TypeVar

T = TypeVar("T")


async def wait_event(event: asyncio.Event, timeout_s: float | None) -> bool:
    """True once `event` is set, False after `timeout_s` (None: no limit)."""
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        return False
    return True


async def next_within(items: AsyncIterator[T], timeout_s: float | None) -> T:
    """The next item of `items`; TimeoutError after `timeout_s`, StopAsyncIteration at its end."""
    async with asyncio.timeout(timeout_s):
        return await anext(items)
