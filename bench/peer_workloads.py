"""The four workloads of `kvmesh bench peer`, built once and sent byte for byte to both systems.

- `agents`: SWE-agent trajectories (bench/agent_workload.py) replayed with their recorded history and a
  seeded tool time between calls. SmolLM2's chat template has no tool syntax, so a step is replayed as
  text: the assistant's thought and command, then the observation as the next user message. A session's
  calls stop before one would not fit the model's context (with room for the answer).
- `chat`: users sharing one long system prompt, each turn adding a question and a recorded answer;
  requests arrive open-loop at a fixed QPS (seeded Poisson).
- `long`: one ~6k-token prompt, sent cold and then warm.
- `decode`: B concurrent short prompts with long answers, for B in the batch sizes.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.bench.agent_workload import build_agent_workload

CONTEXT_ROOM = 64  # tokens kept free for the answer when a prompt is fitted to the context


@dataclass(frozen=True, slots=True)
class Call:
    messages: tuple[dict, ...]
    max_tokens: int
    pause_s: float = 0.0  # agents: the tool time after this call, before the next


@dataclass(frozen=True, slots=True)
class Session:
    start_s: float
    calls: tuple[Call, ...]


@dataclass(frozen=True, slots=True)
class Workloads:
    agents: tuple[Session, ...]
    chat: tuple[tuple[float, Call], ...]  # (arrival offset, call)
    long: Call
    decode: dict[int, tuple[Call, ...]]  # batch size -> its concurrent calls
    notes: dict = field(default_factory=dict)


Counter = Callable[[list[dict]], int]  # prompt tokens of a chat, with the model's template


def agent_sessions(repo_root: Path, count: int, calls: int, max_tokens: int, context: int, tokens: Counter,
                   seed: int) -> tuple[tuple[Session, ...], int]:
    """`count` sessions of up to `calls` calls each; also how many calls were cut to fit the context."""
    w = build_agent_workload(repo_root, count, seed=seed, arrival_rate=0.5, max_steps=calls)
    out, cut = [], 0
    for s in w.sessions:
        history: list[dict] = [{"role": "system", "content": s.system}, {"role": "user", "content": s.task}]
        session: list[Call] = []
        for step in s.steps:
            if tokens(history) + max_tokens + CONTEXT_ROOM > context:
                cut += len(s.steps) - len(session)
                break
            session.append(Call(tuple(history), max_tokens, step.tool_s))
            history = [*history, {"role": "assistant", "content": f"{step.thought}\n```\n{step.command}\n```"},
                       {"role": "user", "content": f"Observation:\n{step.observation}"}]
        if session:
            out.append(Session(s.start_s, tuple(session)))
    return tuple(out), cut


_WORDS = ("the agent reads each file before it edits and runs the tests after every change so that a failing "
          "case is found early while the context still holds the plan the tools and the last result").split()


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words)).capitalize() + "."


def chat_requests(users: int, turns: int, qps: float, max_tokens: int, seed: int) -> tuple[tuple[float, Call], ...]:
    """Open-loop requests at `qps`: request i is user i % users' turn i // users (answers are recorded text)."""
    rng = random.Random(seed)
    system = "You are a support assistant for a software team. " + " ".join(_text(rng, 24) for _ in range(40))
    histories = [[{"role": "system", "content": system}] for _ in range(users)]
    out, t = [], 0.0
    for i in range(users * turns):
        h = histories[i % users]
        h.append({"role": "user", "content": f"Question {i // users + 1}: {_text(rng, 30)}"})
        out.append((t, Call(tuple(h), max_tokens)))
        h.append({"role": "assistant", "content": _text(rng, 50)})
        t += rng.expovariate(qps)
    return tuple(out)


def long_prompt(tokens: Counter, target: int, max_tokens: int, seed: int) -> Call:
    rng = random.Random(seed)
    body = [_text(rng, 40) for _ in range(target // 40)]
    while body and tokens([{"role": "user", "content": " ".join(body)}]) > target:
        body.pop()
    return Call(({"role": "user", "content": "Summarize this log in one line:\n" + " ".join(body)},), max_tokens)


TOPICS = ("a lighthouse", "a robot", "the sea", "a city at night", "a mountain", "a small dog", "a library",
          "a train", "the moon", "a garden", "a storm", "a violin", "a desert", "a bakery", "a river", "a castle")


def decode_batches(batches: tuple[int, ...], max_tokens: int) -> dict[int, tuple[Call, ...]]:
    return {b: tuple(Call(({"role": "user", "content": f"Write a long story about {TOPICS[i % len(TOPICS)]} "
                                                       f"(number {i})."},), max_tokens) for i in range(b))
            for b in batches}
