"""Agent trajectories (SWE-agent ``.traj``) as a hash-id trace of interleaved sessions.

A trajectory's ``history`` is the chat its agent sent an LLM; call k sends the
history up to (not including) its k-th assistant message, chat-templated, and
the model answers with that message. Sessions are seeded copies of sampled
trajectories, started by Poisson arrivals and interleaved in time; each
request's prompt tokens are cut into blocks whose ids are chained hashes, so
a session's turns share their leading ids (see docs/agent-traces.md for the
modeling choices and their parameters).

Contracts:
- ids are deterministic (blake2b, not Python's ``hash``): same inputs and
  seed give the same trace;
- a block's id depends on its parent's id and its tokens, plus the session's
  salt once the block reaches past the shared system prompt, so copies of
  one trajectory share only the system prompt's blocks;
- within a session, timestamps strictly increase; the trace is sorted by time.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kvmesh.sim.trace import TRACE_BLOCK_TOKENS

ID_MASK = (1 << 63) - 1
# SWE-agent declares its own commands in the system prompt as "name:\n  docstring: ...".
_DECLARED_COMMAND = re.compile(r"^(\w+):\n\s+docstring:", re.MULTILINE)
SHELL_TOOL = "bash"  # the tool an undeclared command runs under (SWE-agent's function-calling mode)


class ChatTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def apply_chat_template(
        self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True
    ) -> str: ...


@dataclass(frozen=True, slots=True)
class Turn:
    """Call k of a trajectory: the prompt is messages[:prompt_messages] plus the generation prompt."""

    prompt_messages: int
    output_tokens: int  # the answer's tokens, its end-of-turn token included
    tools: tuple[str, ...]  # what the answer called; () for a plain answer and for the task's last turn
    tool_s: float | None  # the recorded execution time of those tools, when the trajectory has one


@dataclass(frozen=True, slots=True)
class Trajectory:
    """One tokenized trajectory: each message's templated tokens and its calls."""

    name: str
    pieces: tuple[tuple[int, ...], ...]  # message i's tokens as the chat template renders it
    generation_prompt: tuple[int, ...]  # what the template appends to ask for an answer
    turns: tuple[Turn, ...]
    system_messages: int  # leading messages every session of the deployment shares (the system prompt)

    def prompt_tokens(self, turn: Turn) -> list[int]:
        return [t for piece in self.pieces[: turn.prompt_messages] for t in piece] + list(self.generation_prompt)

    @property
    def total_tokens(self) -> int:
        return sum(len(p) for p in self.pieces)


def declared_commands(system_prompt: str) -> frozenset[str]:
    """The commands a SWE-agent system prompt documents (``name:`` followed by a docstring)."""
    return frozenset(_DECLARED_COMMAND.findall(system_prompt))


def tool_names(message: dict, declared: frozenset[str]) -> tuple[str, ...]:
    """The tools an assistant message calls.

    Structured ``tool_calls`` give their function names. A text action calls
    the SWE-agent command it starts with when the system prompt declares it,
    else the shell (``bash``), as SWE-agent's function-calling mode names it.
    No action: a plain answer, ``()``.
    """
    calls = message.get("tool_calls") or []
    if calls:
        return tuple(str((c.get("function") or c).get("name", SHELL_TOOL)) for c in calls)
    words = str(message.get("action") or "").split()
    if not words:
        return ()
    return (words[0],) if words[0] in declared else (SHELL_TOOL,)


def _recorded_tool_times(actions: Sequence[str], steps: Sequence[dict]) -> list[float | None]:
    """``execution_time`` per action, matching trajectory steps by action in order (retried
    steps can be missing from the history, so step k is not always action k)."""
    out: list[float | None] = []
    j = 0
    for action in actions:
        k = j
        while k < len(steps) and str(steps[k].get("action") or "") != action:
            k += 1
        if k < len(steps):
            t = steps[k].get("execution_time")
            out.append(float(t) if isinstance(t, (int, float)) and t >= 0 else None)
            j = k + 1
        else:
            out.append(None)
    return out


def _pieces(history: list[dict], tokenizer: ChatTokenizer) -> tuple[list[tuple[int, ...]], tuple[int, ...]]:
    """Each message's tokens, cut from incremental renders of the chat template.

    The template must render history[:i] as a prefix of history[:i+1]; each
    piece then begins and ends with a special token, so tokenizing pieces
    apart gives the tokens of the whole prompt (tests check this).
    """
    rendered = [tokenizer.apply_chat_template(history[:i], add_generation_prompt=False)
                for i in range(len(history) + 1)]
    texts = []
    for i in range(len(history)):
        if not rendered[i + 1].startswith(rendered[i]):
            raise ValueError(f"chat template does not render message {i} as an extension of the ones before")
        texts.append(rendered[i + 1][len(rendered[i]):])
    if history:  # message 0 also carries what the template writes first (the BOS token)
        texts[0] = rendered[1]
    full = tokenizer.apply_chat_template(history, add_generation_prompt=True)
    generation = tuple(tokenizer.encode(full[len(rendered[-1]):]))
    return [tuple(tokenizer.encode(t)) for t in texts], generation


def load_trajectory(path: Path, tokenizer: ChatTokenizer) -> Trajectory:
    """Read and tokenize one ``.traj`` file; ``ValueError`` if it has no assistant message."""
    data = json.loads(path.read_text(encoding="utf-8"))
    history = [{**m, "content": m.get("content") or ""} for m in data.get("history") or []]
    assistants = [i for i, m in enumerate(history) if m.get("role") == "assistant"]
    if not assistants:
        raise ValueError(f"{path.name}: no assistant message in its history")
    system = 1 if history[0].get("role") == "system" else 0
    declared = declared_commands(history[0]["content"]) if system else frozenset()
    pieces, generation = _pieces(history, tokenizer)
    recorded = _recorded_tool_times([str(history[i].get("action") or "") for i in assistants],
                                    data.get("trajectory") or [])
    turns = []
    for k, i in enumerate(assistants):
        last = k == len(assistants) - 1  # the run ends: its result goes back to the person
        turns.append(Turn(
            prompt_messages=i,
            output_tokens=max(1, len(pieces[i]) - len(generation)),
            tools=() if last else tool_names(history[i], declared),
            tool_s=recorded[k],
        ))
    return Trajectory(path.stem, tuple(pieces), generation, tuple(turns), system)


def load_trajectories(
    directory: Path, tokenizer: ChatTokenizer, on_file: Callable[[str], None] | None = None
) -> list[Trajectory]:
    """All ``*.traj`` files of ``directory`` in name order; ``FileNotFoundError`` if none."""
    paths = sorted(directory.glob("*.traj"))
    if not paths:
        raise FileNotFoundError(f"no .traj files in {directory}")
    out = []
    for path in paths:
        out.append(load_trajectory(path, tokenizer))
        if on_file is not None:
            on_file(path.name)
    return out


def agent_preset_tokenizer() -> ChatTokenizer:
    """The tokenizer and chat template of the ``agent`` preset (what ``kvmesh up`` serves)."""
    import tempfile

    from kvmesh.engine.presets import write_preset
    from kvmesh.engine.tokenizer import Tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        return Tokenizer.from_dir(write_preset(Path(tmp), "agent"))


def chain_ids(tokens: Sequence[int], salt: bytes, shared_tokens: int = 0,
              block_tokens: int = TRACE_BLOCK_TOKENS) -> list[int]:
    """Chained 63-bit ids of ``tokens`` cut into blocks (the last one may be partial).

    id = blake2b(parent id, salt, tokens): the salt is left out of blocks that
    end within the first ``shared_tokens`` tokens (the deployment's shared
    system prompt), so only those are common to all sessions.
    """
    ids: list[int] = []
    parent = 0
    for start in range(0, len(tokens), block_tokens):
        block = tokens[start:start + block_tokens]
        h = hashlib.blake2b(parent.to_bytes(8, "big"), digest_size=8)
        if start + len(block) > shared_tokens:
            h.update(salt)
        h.update(struct.pack(f"<{len(block)}I", *block))
        parent = int.from_bytes(h.digest(), "big") & ID_MASK
        ids.append(parent)
    return ids


@dataclass(frozen=True, slots=True)
class Timing:
    """How long a turn takes and what follows it (seconds; draws are seeded per session).

    A turn generates for ``output_tokens / output_tokens_per_s``; then the agent
    runs its tools for the recorded ``execution_time`` if any, else a
    log-normal draw (median ``tool_median_s``, sigma ``tool_sigma``, capped at
    ``tool_cap_s``). When a task ends, the same user follows up in the same
    conversation with another task with probability ``follow_up``, after a
    log-normal human gap (median ``human_median_s``, sigma ``human_sigma``).
    """

    output_tokens_per_s: float = 50.0
    tool_median_s: float = 1.5
    tool_sigma: float = 0.8
    tool_cap_s: float = 30.0
    follow_up: float = 0.25
    human_median_s: float = 90.0
    human_sigma: float = 1.0

    def tool_s(self, rng: random.Random) -> float:
        return min(self.tool_cap_s, self.tool_median_s * math.exp(self.tool_sigma * rng.gauss(0.0, 1.0)))

    def human_s(self, rng: random.Random) -> float:
        return self.human_median_s * math.exp(self.human_sigma * rng.gauss(0.0, 1.0))


@dataclass(frozen=True, slots=True)
class SessionsConfig:
    """``sessions`` sessions start at Poisson arrivals (``rate`` per second), each a copy of a
    trajectory drawn uniformly with replacement; prompts stay within ``max_tokens``."""

    sessions: int = 400
    rate: float = 2.0
    seed: int = 0
    timing: Timing = Timing()
    max_tokens: int = 32768  # the agent preset's positions
    block_tokens: int = TRACE_BLOCK_TOKENS
    share_system_prompt: bool = True
    sub_agents: float = 0.0  # chance a session forks one sub-agent (see `session_rows`)
    sub_agent_turns: int = 8  # the most turns a sub-agent runs before it answers its parent


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One request of the trace, in the Mooncake JSONL fields plus the two agent fields."""

    time_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    session_id: str
    tool_calls: tuple[str, ...]
    parent_session_id: str | None = None  # a sub-agent's parent

    def to_json(self, session_id: bool = True) -> str:
        """One trace line; without `session_id` the server must infer the sessions (and sub-agents' parents),
        as for clients that name none."""
        line = {
            "timestamp": round(self.time_s * 1000), "input_length": self.input_length,
            "output_length": self.output_length, "hash_ids": list(self.hash_ids),
            "session_id": self.session_id, "tool_calls": list(self.tool_calls),
        }
        if self.parent_session_id is not None:
            line["parent_session_id"] = self.parent_session_id
        if not session_id:
            del line["session_id"]
            line.pop("parent_session_id", None)
        return json.dumps(line)


def _tokens(pieces: Sequence[tuple[int, ...]]) -> list[int]:
    return [t for piece in pieces for t in piece]


def session_rows(index: int, start_s: float, pool: Sequence[Trajectory], config: SessionsConfig) -> list[TraceRow]:
    """The requests of session ``index``: one or more tasks in one growing conversation, and its sub-agent's.

    A follow-up task appends its messages after the system prompt to the
    conversation so far, and is drawn among those that fit ``max_tokens``;
    a task stops at a turn that would not fit.

    With chance ``sub_agents`` the session forks a sub-agent at one tool-call
    turn of its first task, drawn uniformly: that turn calls the tool
    ``task``, whose run is the sub-agent's (`_sub_agent_rows`); the session
    goes on once the sub-agent has answered.
    """
    rng = random.Random(f"{config.seed}:session:{index}")
    timing = config.timing
    salt = hashlib.blake2b(f"{config.seed}:salt:{index}".encode(), digest_size=16).digest()
    session_id = f"s{index:05d}"
    traj = rng.choice(pool)
    shared = len(_tokens(traj.pieces[: traj.system_messages])) if config.share_system_prompt else 0
    fork_rng = random.Random(f"{config.seed}:sub-agent:{index}")  # its own draws: sub_agents=0 changes nothing
    forks = [k for k, turn in enumerate(traj.turns[:-1]) if turn.tools]
    fork_at = fork_rng.choice(forks) if forks and fork_rng.random() < config.sub_agents else None
    context: list[int] = []
    skip = 0  # the first task brings the system prompt; follow-ups continue after it
    rows: list[TraceRow] = []
    t = start_s
    while True:
        for k, turn in enumerate(traj.turns):
            prompt = context + _tokens(traj.pieces[skip: turn.prompt_messages]) + list(traj.generation_prompt)
            if len(prompt) + turn.output_tokens > config.max_tokens:
                break
            ids = chain_ids(prompt, salt, shared, config.block_tokens)
            tools = ("task",) if k == fork_at else turn.tools
            rows.append(TraceRow(t, len(prompt), turn.output_tokens, tuple(ids), session_id, tools))
            t += turn.output_tokens / timing.output_tokens_per_s
            if k == fork_at:
                context_so_far = prompt[: len(prompt) - len(traj.generation_prompt)]
                child = _sub_agent_rows(f"{session_id}.sub", session_id, t, context_so_far, salt, shared, pool,
                                        config, fork_rng)
                rows += child
                if child:
                    t = child[-1].time_s + child[-1].output_length / timing.output_tokens_per_s
                fork_at = None  # one sub-agent per session
            elif k < len(traj.turns) - 1:
                t += turn.tool_s if turn.tool_s is not None else timing.tool_s(rng)
        else:
            context = context + _tokens(traj.pieces[skip:])
            if rng.random() < timing.follow_up:
                fits = [x for x in pool if len(context) + _follow_up_tokens(x) <= config.max_tokens]
                if fits:
                    traj = rng.choice(fits)
                    skip = traj.system_messages
                    t += timing.human_s(rng)
                    continue
        return rows


def _sub_agent_rows(session_id: str, parent: str, start_s: float, prefix: list[int], salt: bytes, shared: int,
                    pool: Sequence[Trajectory], config: SessionsConfig, rng: random.Random) -> list[TraceRow]:
    """A sub-agent forked from its parent's context ``prefix``: it sends that context and then a task of
    its own (a trajectory's messages after its system prompt, drawn among those that fit), runs at most
    ``sub_agent_turns`` turns, and gives its last answer back to the parent (``[]``)."""
    fits = [x for x in pool if len(prefix) + _follow_up_tokens(x) <= config.max_tokens]
    if not fits:
        return []
    traj = rng.choice(fits)
    turns = traj.turns[: config.sub_agent_turns]
    rows, t = [], start_s
    for k, turn in enumerate(turns):
        prompt = prefix + _tokens(traj.pieces[traj.system_messages: turn.prompt_messages]) + list(traj.generation_prompt)
        last = k == len(turns) - 1
        ids = chain_ids(prompt, salt, shared, config.block_tokens)
        rows.append(TraceRow(t, len(prompt), turn.output_tokens, tuple(ids), session_id,
                             () if last else turn.tools, parent))
        t += turn.output_tokens / config.timing.output_tokens_per_s
        if not last:
            t += turn.tool_s if turn.tool_s is not None else config.timing.tool_s(rng)
    return rows


def _follow_up_tokens(traj: Trajectory) -> int:
    """The most a follow-up with ``traj`` adds to a conversation: its messages after the
    system prompt, the generation prompt and the last answer."""
    return traj.total_tokens - len(_tokens(traj.pieces[: traj.system_messages])) + len(traj.generation_prompt)


def poisson_starts(n: int, rate: float, seed: int) -> list[float]:
    """``n`` arrival times (s) of a Poisson process of ``rate`` per second, the first at 0."""
    if rate <= 0:
        raise ValueError(f"session rate must be > 0, got {rate}")
    rng = random.Random(f"{seed}:arrivals")
    starts, t = [], 0.0
    for _ in range(n):
        starts.append(t)
        t += rng.expovariate(rate)
    return starts


def build_trace(
    pool: Sequence[Trajectory], config: SessionsConfig, progress: Callable[[int], None] | None = None
) -> list[TraceRow]:
    """All sessions' requests interleaved by time (ties keep session, then turn, order)."""
    if not pool:
        raise ValueError("no trajectories to build sessions from")
    keyed: list[tuple[int, int, int, TraceRow]] = []
    for i, start in enumerate(poisson_starts(config.sessions, config.rate, config.seed)):
        for j, row in enumerate(session_rows(i, start, pool, config)):
            keyed.append((round(row.time_s * 1000), i, j, row))
        if progress is not None:
            progress(1)
    keyed.sort(key=lambda x: x[:3])
    return [row for *_, row in keyed]


def write_trace(rows: Sequence[TraceRow], path: Path, session_ids: bool = True) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(row.to_json(session_ids) + "\n")


def summarize(rows: Sequence[TraceRow]) -> dict:
    """The one-line summary: sizes, the tool-call turn fraction and how many sessions overlap."""
    spans: dict[str, list[float]] = {}
    for row in rows:
        spans.setdefault(row.session_id, [row.time_s, row.time_s])[1] = row.time_s
    span = (rows[-1].time_s - rows[0].time_s) if rows else 0.0
    busy = sum(b - a for a, b in spans.values())
    edges = sorted([(a, 1) for a, _ in spans.values()] + [(b, -1) for _, b in spans.values()])
    active = peak = 0
    for _, step in edges:  # at equal times an end (-1) sorts first: touching sessions do not overlap
        active += step
        peak = max(peak, active)
    return {
        "requests": len(rows),
        "sessions": len(spans),
        "unique_blocks": len({h for row in rows for h in row.hash_ids}),
        "input_blocks": sum(len(row.hash_ids) for row in rows),
        "input_tokens": sum(row.input_length for row in rows),
        "output_tokens": sum(row.output_length for row in rows),
        "tool_call_turn_fraction": round(sum(1 for r in rows if r.tool_calls) / len(rows), 4) if rows else 0.0,
        "sub_agent_sessions": len({r.session_id for r in rows if r.parent_session_id is not None}),
        "span_s": round(span, 1),
        "mean_active_sessions": round(busy / span, 1) if span else 0.0,
        "peak_active_sessions": peak,
    }


def iter_sessions(rows: Sequence[TraceRow]) -> Iterator[tuple[str, list[TraceRow]]]:
    """Each session's rows in trace order (what tests and analyses group by)."""
    groups: dict[str, list[TraceRow]] = {}
    for row in rows:
        groups.setdefault(row.session_id, []).append(row)
    yield from groups.items()
