"""Timed waits keep a cancel that arrives in the same loop turn as their result (asyncio.wait_for on 3.11 drops it)."""

from __future__ import annotations

import asyncio
import sys

import pytest
from kvmesh.aio import cancel_and_wait, next_within, wait_event


async def _queue_items(q: asyncio.Queue[int]):
    while True:
        yield await q.get()


async def _cancel_as_it_arrives(waiting, arrive) -> asyncio.Task:
    parked = asyncio.Event()

    async def wait():
        parked.set()  # wakes us only after the next line has suspended in the wait
        return await waiting

    task = asyncio.create_task(wait())
    await parked.wait()
    arrive()  # the awaited result lands ...
    task.cancel()  # ... and the owner stops the task in the same turn
    await asyncio.wait({task})
    return task


async def test_wait_event_keeps_a_cancel_that_races_the_event():
    event = asyncio.Event()
    task = await _cancel_as_it_arrives(wait_event(event, 5.0), event.set)
    assert task.cancelled()


async def test_next_within_keeps_a_cancel_that_races_the_item():
    q: asyncio.Queue[int] = asyncio.Queue()
    task = await _cancel_as_it_arrives(next_within(_queue_items(q), 5.0), lambda: q.put_nowait(1))
    assert task.cancelled()
    assert q.qsize() == 1  # the item is not lost to the cancelled wait


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="wait_for keeps the cancel from 3.12 on")
async def test_the_race_is_real_for_wait_for():
    """Why the helpers exist: on this Python, asyncio.wait_for returns the result and the cancel is lost."""
    event = asyncio.Event()
    task = await _cancel_as_it_arrives(asyncio.wait_for(event.wait(), 5.0), event.set)
    assert not task.cancelled() and task.result() is True


async def test_timeouts_and_results():
    event = asyncio.Event()
    assert await wait_event(event, 0.01) is False
    event.set()
    assert await wait_event(event, None) is True
    q: asyncio.Queue[int] = asyncio.Queue()
    with pytest.raises(TimeoutError):
        await next_within(_queue_items(q), 0.01)
    q.put_nowait(7)
    assert await next_within(_queue_items(q), 1.0) == 7

    async def empty():
        return
        yield

    with pytest.raises(StopAsyncIteration):
        await next_within(empty(), 1.0)


async def test_cancel_and_wait_ends_a_task_that_lost_its_first_cancel():
    """A loop whose cancel a library swallowed (as 3.11's wait_for does) runs on; the next cancel ends it."""
    started, lost = asyncio.Event(), [0]

    async def swallows_one_cancel() -> None:
        started.set()
        while True:
            try:
                await asyncio.Event().wait()  # parked until cancelled
            except asyncio.CancelledError:
                if lost[0]:
                    raise
                lost[0] += 1  # lost, as if it arrived with a result: the loop goes on

    plain = asyncio.create_task(asyncio.Event().wait())
    stubborn = asyncio.create_task(swallows_one_cancel())
    await started.wait()
    await asyncio.wait_for(cancel_and_wait([plain, stubborn], resend_s=0.05), 10)
    assert plain.cancelled() and stubborn.cancelled() and lost[0] == 1
