"""Facts about recorded processes from /proc: identity, liveness, memory, and stopping them.

Only a PID whose kernel start time matches the recorded one counts as ours;
anything else is treated as gone and is never signalled.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from kvmesh.stack.servers import pid_alive
from kvmesh.stack.state import ProcessRecord, StackState


def start_ticks(pid: int) -> int:
    """Kernel start time of pid in clock ticks since boot; 0 when it does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22 of stat, counted after "comm)"


def is_ours(rec: ProcessRecord) -> bool:
    """Alive, not a zombie, and the same process that was recorded."""
    return pid_alive(rec.pid) and start_ticks(rec.pid) == rec.start_ticks


def launcher_alive(state: StackState) -> bool:
    """The `kvmesh up` that wrote state is still running (starting, or holding a foreground stack)."""
    return state.launcher_ticks != 0 and start_ticks(state.launcher_pid) == state.launcher_ticks \
        and pid_alive(state.launcher_pid)


def rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) a running process and the processes it started have used so far: its own and
    its live descendants' (0.0 for what is gone)."""
    total = 0
    for p in [pid, *descendants(pid)]:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15, counted after "comm)"
    return total / os.sysconf("SC_CLK_TCK")


def allowed_cpus(pid: int) -> str:
    """`Cpus_allowed_list` of a running process, as /proc writes it ("" when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


@dataclass(slots=True)
class ProcessStatus:
    name: str
    pid: int
    alive: bool
    rss_bytes: int  # the process and the processes it started (a vLLM worker's engine core is a child)
    uptime_s: float
    log: str
    cpus: str = ""  # the cores it may run on (Cpus_allowed_list)
    children: int = 0  # processes below it


def process_status(rec: ProcessRecord) -> ProcessStatus:
    alive = is_ours(rec)
    below = descendants(rec.pid) if alive else []
    return ProcessStatus(
        name=rec.name,
        pid=rec.pid,
        alive=alive,
        rss_bytes=sum(rss_bytes(p) for p in [rec.pid, *below]) if alive else 0,
        uptime_s=round(time.time() - rec.started_at, 1) if alive else 0.0,
        log=rec.log,
        cpus=allowed_cpus(rec.pid) if alive else "",
        children=len(below),
    )


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children, theirs, ...), from /proc."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # field 4, counted after "comm)"
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def stop_all(records: list[ProcessRecord], grace_s: float) -> None:
    """SIGTERM every process of ours at once, SIGKILL what is left after grace_s (and the processes it started:
    a vLLM engine's workers outlive a killed parent), wait until gone."""
    live = [r for r in records if is_ours(r)]
    for r in live:
        _signal(r.pid, signal.SIGTERM)
    end = time.monotonic() + grace_s
    while live and time.monotonic() < end:
        live = [r for r in live if pid_alive(r.pid)]
        time.sleep(0.05)
    for r in live:
        for child in descendants(r.pid):
            _signal(child, signal.SIGKILL)
        _signal(r.pid, signal.SIGKILL)
    end = time.monotonic() + 5.0  # SIGKILL cannot be refused; this only bounds an uninterruptible sleep
    while live and time.monotonic() < end:
        live = [r for r in live if pid_alive(r.pid)]
        time.sleep(0.02)


def stop_in_order(records: list[ProcessRecord], grace_s: float) -> None:
    """Services first (they drain into NATS and S3), then the servers."""
    stop_all([r for r in records if r.kind == "service"], grace_s)
    stop_all([r for r in records if r.kind == "server"], grace_s)


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
