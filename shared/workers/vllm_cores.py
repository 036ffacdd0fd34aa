"""Which cores a vLLM engine computes on: set explicitly, read back from its own log.

vLLM's CPU build binds its engine's OpenMP threads to the machine's cores less a
reserved few (`VLLM_CPU_OMP_THREADS_BIND=auto`): one with no KV connector, two
with one, none when that leaves nothing. On a 2-core box plain vLLM then
computes on one core and a vLLM with a connector on two. kvmesh's own vLLM
workers, and every vLLM a bench compares with, get the same cores instead: the
binding and the reserved count are set, and what vLLM did is read from the
"core ids" line it logs, never assumed from what was asked.
"""

from __future__ import annotations

import os
import re

CORE_IDS = re.compile(r"local_rank=\d+, core ids=\[([\d, ]*)\]")
RESERVED = re.compile(r"reserved_cpus=\[([\d, ]*)\]")


def allowed_cores(pid: int | None = None) -> list[int]:
    """The cores this process (or `pid`) may run on."""
    return sorted(os.sched_getaffinity(pid or 0))


def cpu_list(cores: list[int]) -> str:
    """`[0, 1, 2, 5]` as `0-2,5`: the form vLLM's binding and /proc's Cpus_allowed_list use."""
    parts: list[str] = []
    for core in sorted(cores):
        if parts and int(parts[-1].rpartition("-")[2]) == core - 1:
            parts[-1] = f"{parts[-1].partition('-')[0]}-{core}"
        else:
            parts.append(str(core))
    return ",".join(parts)


def bind_env(cores: list[int]) -> dict[str, str]:
    """The environment that puts a vLLM engine's threads on exactly `cores`, reserving none."""
    if not cores:
        raise ValueError("a vLLM engine needs at least one core")
    return {"VLLM_CPU_OMP_THREADS_BIND": cpu_list(cores), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "OMP_NUM_THREADS": str(len(cores))}


def logged_binding(log: str) -> dict[str, list[int]] | None:
    """The cores vLLM says it bound its engine to and those it reserved, from its log text; None before it says."""
    bound = CORE_IDS.findall(log)
    if not bound:
        return None
    reserved = RESERVED.findall(log)
    ids = lambda text: [int(x) for x in text.replace(" ", "").split(",") if x]  # noqa: E731
    return {"core_ids": sorted({c for group in bound for c in ids(group)}),
            "reserved_cpus": ids(reserved[-1]) if reserved else []}

