"""Work that must never take a core from serving: threads the OS runs only on what is left, and a
look at whether the host has anything left.

An L3 upload (a chunk's join copy, its SHA-256 for S3, the HTTP send) is
bulk work that may wait, while a token may not. `background_executor`
gives such work a thread of its own at the lowest OS priority (Linux
`setpriority` on the thread: nice 19), so on a busy box the scheduler runs
the engine and the event loop first. Python's GIL is released by the copies,
hashes and socket writes that make up most of it; a niced thread that is
preempted while holding the GIL keeps it at most one switch interval (5 ms)
once another thread asks for it.

A lower priority does not stop bulk copies from taking memory bandwidth from
a decode step on the same host (another process), which reads a whole
context's KV each step. `HostIdle` says whether the host's cores were mostly
idle since it last looked (Linux `/proc/stat`), so such work can wait for a
quiet moment.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

LOWEST_PRIORITY = 19


def lower_this_thread() -> None:
    """Put the calling thread at the lowest OS priority (a no-op where the OS does not allow it)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST_PRIORITY)
    except (AttributeError, OSError):  # not Linux, or not allowed: it runs at normal priority
        pass


def background_executor(name: str, workers: int = 1) -> ThreadPoolExecutor:
    """`workers` threads named `name`, each at the lowest OS priority (where the OS lets a thread have one)."""
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name, initializer=lower_this_thread)


def thread_nice(native_id: int) -> int:
    """The nice value of a thread of this process (tests; Linux)."""
    return os.getpriority(os.PRIO_PROCESS, native_id)


class HostIdle:
    """Whether this host's CPUs were busy since the last look (`/proc/stat`; elsewhere: never busy)."""

    def __init__(self, min_idle: float = 0.5, path: str = "/proc/stat") -> None:
        self.min_idle = min_idle  # the idle share of all cores below which the host counts as busy
        self.path = path
        self._last = self._sample()
        self._busy = False

    def _sample(self) -> tuple[int, int] | None:
        """(idle + iowait jiffies, all jiffies) of the `cpu` line."""
        try:
            with open(self.path) as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        return fields[3] + (fields[4] if len(fields) > 4 else 0), sum(fields)

    def busy(self) -> bool:
        """True if less than `min_idle` of the cores' time since the previous call was idle (the previous
        answer when too little time passed to tell)."""
        now = self._sample()
        if now is None or self._last is None:
            return False
        idle, total = now[0] - self._last[0], now[1] - self._last[1]
        if total <= 0:
            return self._busy
        self._last = now
        self._busy = idle / total < self.min_idle
        return self._busy
