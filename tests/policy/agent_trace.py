"""A synthetic agent trace: interleaved sessions whose tool-call turns return in seconds.

Each session (started at Poisson times) shares a system prompt with every
other session, then sends turns that each re-send the whole history plus a
few new blocks. A turn ends with one tool call (its latency log-normal
around the tool's own median, plus the model's generation time) or, last,
with an answer: the session is over, or, sometimes, its person replies
minutes later and the agent runs a few more tool turns. The trace carries
``session_id`` and ``tool_calls`` as agent traces do; never the gap.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from kvmesh.sim.trace import TRACE_BLOCK_TOKENS, Trace, parse_line

TOOLS = {"bash": 4.0, "edit": 1.0, "search": 8.0}  # median latency (s) of each tool
SYSTEM_BLOCKS = 4
GENERATE_S = 3.0  # the model's answer before the tool runs


def agent_rows(sessions: int = 60, seed: int = 0, start_rate_s: float = 1.0, turns: tuple[int, int] = (6, 20),
               reply_p: float = 0.3) -> list[dict]:
    rng = random.Random(seed)
    next_id = SYSTEM_BLOCKS
    rows: list[dict] = []
    t0 = 0.0
    for s in range(sessions):
        t0 += rng.expovariate(1.0 / start_rate_s)
        chain = list(range(SYSTEM_BLOCKS))
        t = t0
        n = rng.randint(*turns)
        replies = 1 if rng.random() < reply_p else 0
        for phase in range(1 + replies):
            for k in range(n if phase == 0 else max(2, n // 3)):
                grow = rng.randint(1, 3)
                chain = chain + list(range(next_id, next_id + grow))
                next_id += grow
                last = k == (n if phase == 0 else max(2, n // 3)) - 1
                tool = None if last else rng.choice(sorted(TOOLS))
                rows.append({
                    "timestamp": round(1000 * t), "input_length": TRACE_BLOCK_TOKENS * len(chain) - 100,
                    "output_length": 50, "hash_ids": chain, "session_id": f"s{s}",
                    "tool_calls": [] if tool is None else [tool],
                })
                if tool is not None:
                    t += GENERATE_S + rng.lognormvariate(0.0, 0.5) * TOOLS[tool]
            t += rng.uniform(60.0, 300.0)  # the person reads and replies
    rows.sort(key=lambda r: r["timestamp"])
    return rows


def agent_trace(**kw) -> Trace:
    rows = agent_rows(**kw)
    return Trace("agent-synthetic", tuple(parse_line(json.dumps(r)) for r in rows))


def write_agent_trace(path: Path, **kw) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in agent_rows(**kw)))
    return path
