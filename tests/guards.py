"""Guards that turn a hung test into a failure with a stack trace instead of a silent stall.

pytest-timeout does not cover pytest-asyncio's event-loop teardown, where
leftover tasks are cancelled once and then awaited: one task that swallows
its CancelledError there stalls the whole run. Two guards:

- `_leftover_tasks` (every async test): before the loop closes, cancel what
  the test left running, cancel again whatever is still alive, and fail the
  test naming each task that outlived its first cancel by `GRACE_S`;
- `pytest_runtest_protocol`: a test that is not done `HARD_LIMIT_S` after
  it started (setup, call and teardown together) prints the failures so far
  and every thread's stack, then ends the run with exit code 70, since the
  process cannot recover.
"""

from __future__ import annotations

import asyncio
import faulthandler
import io
import os
import sys
import threading
from collections.abc import AsyncIterator, Iterator

import pytest

GRACE_S = 5.0
HARD_LIMIT_S = 600.0


@pytest.fixture
async def _leftover_tasks() -> AsyncIterator[None]:
    yield
    me = asyncio.current_task()
    left = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
    for task in left:
        task.cancel()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + GRACE_S
    stuck: list[asyncio.Task] = []
    while pending := [t for t in left if not t.done()]:
        if loop.time() > deadline:
            stuck = pending
            break
        await asyncio.wait(pending, timeout=0.2)
    if not stuck:
        return
    report = io.StringIO()
    for task in stuck:
        task.print_stack(file=report)
    for _ in range(20):  # a swallowed cancel usually yields to the next one
        for task in stuck:
            task.cancel()
        await asyncio.wait(stuck, timeout=0.1)
    pytest.fail(f"{len(stuck)} task(s) still running {GRACE_S:.0f}s after being cancelled:\n{report.getvalue()}")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("asyncio") is not None and "_leftover_tasks" not in item.fixturenames:
            item.fixturenames.insert(0, "_leftover_tasks")  # set up first, so torn down last before the loop


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    timer = threading.Timer(HARD_LIMIT_S, _abort, args=(item,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _abort(item: pytest.Item) -> None:
    capture = item.config.pluginmanager.getplugin("capturemanager")
    if capture is not None:
        capture.suspend_global_capture()  # give the real stderr back: what follows must reach the log
    reporter = item.config.pluginmanager.getplugin("terminalreporter")
    for report in (reporter.stats.get("failed", []) + reporter.stats.get("error", [])) if reporter else []:
        sys.stderr.write(f"\n\n{report.nodeid} ({report.when}) failed earlier:\n{report.longreprtext}\n")
    sys.stderr.write(f"\n\n{item.nodeid} has not finished after {HARD_LIMIT_S:.0f}s; every thread's stack:\n")
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    os._exit(70)
