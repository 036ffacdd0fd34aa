"""Bounded client load: a few concurrent greedy sessions through the openai SDK, every outcome recorded.

Each session loops over its own prompts (streamed completions, temperature
0) until `stop` is set or its request budget is spent. A request is either
ok (its full text) or errored (the exception's type and message); the
client never retries, so what the server did is what is recorded.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import openai

PROMPTS = tuple(f"Session {i} asks about tide pools, question {j}:" for i in range(4) for j in range(3))


@dataclass(slots=True)
class Outcome:
    prompt: str
    started: float  # monotonic seconds
    ended: float
    ok: bool
    text: str = ""
    error: str = ""
    status: int | None = None  # HTTP status of an error, when there was one

    @property
    def latency_ms(self) -> float:
        return (self.ended - self.started) * 1000


@dataclass
class Load:
    base_url: str
    api_key: str
    model: str
    sessions: int = 3
    max_tokens: int = 24
    request_timeout_s: float = 60.0
    max_requests: int = 2000  # per session: the loop is bounded even if stop is never set (a 120 s run sends ~500)
    outcomes: list[Outcome] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=self.api_key, max_retries=0,
                             timeout=self.request_timeout_s)

    def one(self, client: openai.OpenAI, prompt: str) -> Outcome:
        started = time.monotonic()
        try:
            stream = client.completions.create(model=self.model, prompt=prompt, max_tokens=self.max_tokens,
                                               temperature=0, stream=True)
            text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
            return Outcome(prompt, started, time.monotonic(), True, text=text)
        except openai.APIStatusError as exc:
            return Outcome(prompt, started, time.monotonic(), False, error=f"{type(exc).__name__}: {exc.message}",
                           status=exc.status_code)
        except openai.APIError as exc:
            return Outcome(prompt, started, time.monotonic(), False, error=f"{type(exc).__name__}: {exc.message}")

    def _session(self, index: int) -> None:
        client = self.client()
        mine = PROMPTS[index::self.sessions] or PROMPTS
        for n in range(self.max_requests):
            if self.stop.is_set():
                return
            outcome = self.one(client, mine[n % len(mine)])
            with self._lock:
                self.outcomes.append(outcome)
            if not outcome.ok:
                self.stop.wait(0.2)  # client back-off: a refused connection must not spin the loop

    def start(self) -> Load:
        self._threads = [threading.Thread(target=self._session, args=(i,), daemon=True) for i in range(self.sessions)]
        for t in self._threads:
            t.start()
        return self

    def finish(self) -> list[Outcome]:
        """Stop after the requests in flight end (each is bounded by request_timeout_s)."""
        self.stop.set()
        for t in self._threads:
            t.join(self.request_timeout_s + 5)
        with self._lock:
            return sorted(self.outcomes, key=lambda o: o.started)

    def references(self) -> dict[str, str]:
        """Fault-free greedy answers of every prompt, one at a time."""
        client = self.client()
        refs: dict[str, str] = {}
        for prompt in PROMPTS:
            outcome = self.one(client, prompt)
            if not outcome.ok:
                raise RuntimeError(f"reference request failed on a healthy stack: {outcome.error}")
            refs[prompt] = outcome.text
        return refs
