"""Send `bench/peer_workloads.py` calls to one OpenAI-compatible server and time every streamed token.

The same code drives kvmesh and vLLM: the official OpenAI SDK, streaming, greedy, usage in the last
chunk (`prompt_tokens_details.cached_tokens`). A call that fails is kept with its error; the figures
count it in `errors` and leave it out of the latencies.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field

from kvmesh.bench.peer_workloads import Call, Session


@dataclass(slots=True)
class Timing:
    workload: str
    sent: float  # time.time() when the request went out
    token_times: list[float] = field(default_factory=list)  # each content chunk's arrival (time.time())
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    request_id: str = ""  # the server's completion id
    error: str = ""

    @property
    def ttft_s(self) -> float:
        return self.token_times[0] - self.sent

    @property
    def ok(self) -> bool:
        return not self.error and bool(self.token_times)


async def send(client, model: str, workload: str, call: Call, **extra) -> Timing:
    """One streamed greedy call; `extra` goes to the SDK (e.g. `extra_body`)."""
    t = Timing(workload, time.time())
    try:
        stream = await client.chat.completions.create(
            model=model, messages=list(call.messages), max_tokens=call.max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, **extra)
        async for chunk in stream:
            t.request_id = t.request_id or chunk.id
            if chunk.choices and chunk.choices[0].delta.content:
                t.token_times.append(time.time())
            if chunk.usage is not None:
                t.prompt_tokens, t.completion_tokens = chunk.usage.prompt_tokens, chunk.usage.completion_tokens
                details = chunk.usage.prompt_tokens_details
                t.cached_tokens = (details.cached_tokens or 0) if details else 0
    except Exception as exc:  # noqa: BLE001 - a failed call is a result, counted in `errors`
        t.error = repr(exc)[:300]
    return t


async def run_sessions(client, model: str, sessions: tuple[Session, ...], say) -> list[Timing]:
    out: list[Timing] = []
    start = time.monotonic()

    async def one(s: Session) -> None:
        await asyncio.sleep(max(0.0, s.start_s - (time.monotonic() - start)))
        for call in s.calls:
            out.append(await send(client, model, "agents", call))
            await asyncio.sleep(call.pause_s)
        say(f"agents: a session done ({len(out)} calls so far)")

    await asyncio.gather(*(one(s) for s in sessions))
    return out


async def run_open_loop(client, model: str, workload: str, arrivals: tuple[tuple[float, Call], ...]) -> list[Timing]:
    start = time.monotonic()

    async def one(at: float, call: Call) -> Timing:
        await asyncio.sleep(max(0.0, at - (time.monotonic() - start)))
        return await send(client, model, workload, call)

    return list(await asyncio.gather(*(one(at, c) for at, c in arrivals)))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def summary(timings: list[Timing], wall_s: float) -> dict:
    ok = [t for t in timings if t.ok]
    ttft = [t.ttft_s for t in ok]
    rates = [(len(t.token_times) - 1) / (t.token_times[-1] - t.token_times[0]) for t in ok
             if len(t.token_times) > 1 and t.token_times[-1] > t.token_times[0]]
    prompt = sum(t.prompt_tokens for t in ok)
    return {
        "requests": len(timings), "errors": len(timings) - len(ok),
        "ttft_s": {"p50": round(pct(ttft, 0.5), 4), "p90": round(pct(ttft, 0.9), 4), "p99": round(pct(ttft, 0.99), 4),
                   "mean": round(statistics.fmean(ttft), 4) if ttft else None},
        "requests_per_s": round(len(ok) / wall_s, 3) if wall_s > 0 else None,
        "decode_tok_s_per_stream": round(statistics.fmean(rates), 2) if rates else None,
        "completion_tokens": sum(t.completion_tokens for t in ok),
        "output_tok_s": round(sum(t.completion_tokens for t in ok) / wall_s, 2) if wall_s > 0 else None,
        "prompt_tokens": prompt, "cached_over_prompt": round(sum(t.cached_tokens for t in ok) / prompt, 3) if prompt else 0,
        "wall_s": round(wall_s, 2),
        "error_examples": sorted({t.error for t in timings if t.error})[:3],
    }
