"""Served traffic as the simulator's trace: what the report replays its baselines and bounds on."""

from __future__ import annotations

import json
from collections.abc import Sequence

from kvmesh.protocol.traffic import TrafficRecord
from kvmesh.sim.trace import Trace, parse_line
from kvmesh.traffic.trace_lines import trace_lines


def as_sim_trace(records: Sequence[TrafficRecord], name: str = "served") -> Trace:
    """The records as `kvmesh sim` reads them from the file `kvmesh trace record` writes, in arrival order."""
    return Trace(name, tuple(parse_line(json.dumps(line)) for line in trace_lines(records)))
