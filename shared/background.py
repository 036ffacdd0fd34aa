"""Threads for work that must never take a core from serving: the OS runs them only on what is left.

An L3 upload (a chunk's join copy, its SHA-256 for S3, the HTTP send) is
bulk work that may wait, while a token may not. `background_executor`
gives such work a thread of its own at the lowest OS priority (Linux
`setpriority` on the thread: nice 19), so on a busy box the scheduler runs
the engine and the event loop first. Python's GIL is released by the copies,
hashes and socket writes that make up most of it; a niced thread that is
preempted while holding the GIL keeps it at most one switch interval (5 ms)
once another thread asks for it.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

LOWEST_PRIORITY = 19


def _lower_this_thread() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST_PRIORITY)
    except (AttributeError, OSError):  # not Linux, or not allowed: it runs at normal priority
        pass


def background_executor(name: str, workers: int = 1) -> ThreadPoolExecutor:
    """`workers` threads named `name`, each at the lowest OS priority (where the OS lets a thread have one)."""
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name, initializer=_lower_this_thread)


def thread_nice(native_id: int) -> int:
    """The nice value of a thread of this process (tests; Linux)."""
    return os.getpriority(os.PRIO_PROCESS, native_id)
