"""The multi-turn agent workload of `kvmesh bench serve`: shared system prompt and tools, growing sessions.

Every session starts with the same system prompt and tool definitions (what
agents of one product share); each turn appends one user/tool message (a
tool output), and the model's answer is appended by the driver. Turns come
from SWE-agent trajectories (`../shared/workloads/swe-agent/*.traj`
relative to the repo root, each file's `history`) when present: the system
prompt of the first one, and each session's tool outputs from one file.
Otherwise they are synthesized from a seeded RNG. Texts are cut to bounds
that keep every session inside the model's context.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

TRAJ_DIR = Path("../shared/workloads/swe-agent")  # relative to the repo root

TOOLS: list[dict] = [
    {"type": "function", "function": {
        "name": "bash", "description": "Run a shell command in the repository and return its output.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}},
    {"type": "function", "function": {
        "name": "open_file", "description": "Show a window of a file with line numbers.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "line": {"type": "integer"}},
                       "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "edit", "description": "Replace lines start..end of the open file with new text.",
        "parameters": {"type": "object", "properties": {"start": {"type": "integer"}, "end": {"type": "integer"},
                                                        "text": {"type": "string"}},
                       "required": ["start", "end", "text"]}}},
]

_WORDS = ("file", "test", "error", "line", "function", "return", "import", "module", "value", "class", "self",
          "assert", "output", "path", "config", "cache", "block", "token", "request", "worker", "found", "None")


@dataclass(frozen=True, slots=True)
class Session:
    name: str
    turns: tuple[str, ...]  # the user/tool message of each turn


@dataclass(frozen=True, slots=True)
class Workload:
    system: str
    tools: list[dict]
    sessions: tuple[Session, ...]
    source: str  # "swe-agent" or "synthetic"

    @property
    def requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)


def _synthetic_text(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < chars:
        words.append(rng.choice(_WORDS))
    return " ".join(words)[:chars]


def _traj_turns(path: Path, max_chars: int) -> list[str]:
    history = json.loads(path.read_text()).get("history") or []
    return [str(m.get("content", ""))[:max_chars] for m in history[1:]
            if m.get("role") in ("user", "tool") and m.get("content")]


def _traj_system(path: Path, max_chars: int) -> str:
    history = json.loads(path.read_text()).get("history") or []
    first = history[0] if history else {}
    return str(first.get("content", ""))[:max_chars] if first.get("role") == "system" else ""


def build_workload(sessions: int, turns: int, repo_root: Path, system_chars: int = 2400,
                   turn_chars: int = 400, seed: int = 0) -> Workload:
    """`sessions` sessions of `turns` turns; from the trajectories if there are enough of them, else synthetic."""
    trajs = sorted((repo_root / TRAJ_DIR).glob("*.traj"))
    per_file = [(p, _traj_turns(p, turn_chars)) for p in trajs]
    usable = [(p, t) for p, t in per_file if len(t) >= turns]
    system = _traj_system(usable[0][0], system_chars) if usable else ""
    if usable and system:
        out = [Session(f"{usable[i % len(usable)][0].stem}-{i}", tuple(
            # sessions that reuse a file get their own first turn, so they are distinct conversations
            (f"[session {i}] " + t if k == 0 else t) for k, t in enumerate(usable[i % len(usable)][1][:turns])))
            for i in range(sessions)]
        return Workload(system, TOOLS, tuple(out), "swe-agent")
    rng = random.Random(seed)
    system = "You are a software engineering agent. " + _synthetic_text(rng, system_chars)
    out = [Session(f"synthetic-{i}", tuple(f"[session {i} turn {k}] " + _synthetic_text(rng, turn_chars)
                                           for k in range(turns))) for i in range(sessions)]
    return Workload(system, TOOLS, tuple(out), "synthetic")
