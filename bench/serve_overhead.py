"""`kvmesh bench serve`'s service overhead: TTFT through the services minus TTFT of an in-process engine.

A few sessions run one request at a time through the stack and through an
`Engine` in this process, fed the same prompt ids (built with the ingress's
own prompt builder, generated ids spliced back as the ingress does) and
warmed with the same shared prefix, so both sides hold the same cache. The
answers must be the same text. Each request is sent a second time: then all
of it is cached on both sides, and the difference is the hops alone.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.bench.serve import KEY, ServeBenchConfig, messages_of, one_request
from kvmesh.bench.serve_workload import Workload


@dataclass(slots=True)
class Overhead:
    """Service TTFT - engine TTFT (ms) per request; `repeat_ms`: the same request again (all of it cached)."""

    ms: list[float] = field(default_factory=list)
    repeat_ms: list[float] = field(default_factory=list)
    identical: int = 0
    total: int = 0


async def overhead(base_url: str, model: str, model_dir: Path, w: Workload, cfg: ServeBenchConfig) -> Overhead:
    """Sessions one request at a time through the services and the in-process engine (same ids, same cache)."""
    import openai
    from kvmesh.config import EngineSettings
    from kvmesh.engine.engine import Engine
    from kvmesh.engine.loader import load_model
    from kvmesh.engine.sampling import SamplingParams
    from kvmesh.ingress.core.prompt import PromptBuilder

    loaded = load_model(model_dir)
    engine = Engine(loaded, EngineSettings())
    prompts = PromptBuilder(loaded.tokenizer, 1024, loaded.config.eos_token_ids)
    params = SamplingParams(max_tokens=cfg.max_tokens, temperature=0.0)

    def engine_ttft(ids: list[int]) -> tuple[float, list[int], str]:
        rid = f"r{time.perf_counter_ns()}"
        engine.add_request(rid, ids, params)
        ttft, out = None, None
        while engine.has_unfinished():
            for o in engine.step():
                ttft = o.ttft if ttft is None and o.ttft is not None else ttft
                out = o
        assert out is not None and ttft is not None
        return ttft, out.token_ids, out.text

    # the services have the shared system prompt and tools cached from the drive: so does the engine
    warm = messages_of(w) + [{"role": "user", "content": "warm-up"}]
    engine_ttft(prompts.chat("bench", warm, w.tools))
    client = openai.AsyncOpenAI(base_url=base_url, api_key=KEY, max_retries=0, timeout=600)
    out = Overhead()
    for i, s in enumerate(w.sessions[: cfg.overhead_sessions]):
        messages = messages_of(w)
        for k, turn in enumerate(s.turns):
            messages.append({"role": "user", "content": f"[overhead {i}] {turn}" if k == 0 else turn})
            for diffs in (out.ms, out.repeat_ms):
                got = await one_request(client, model, messages, w.tools, cfg.max_tokens, f"overhead-{i}")
                ttft, ids, text = await asyncio.to_thread(engine_ttft, prompts.chat("bench", messages, w.tools))
                diffs.append((got.ttft_s - ttft) * 1000)
            prompts.remember_answer("bench", text, ids)
            out.identical += got.text == text
            out.total += 1
            messages.append({"role": "assistant", "content": got.text})
    await client.close()
    return out
