"""`kvmesh bench peer`'s parts, without running vLLM: the refusal, the workloads, the figures, and the
kvmesh breakdown joined on a real stack's own log lines."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from pathlib import Path

from kvmesh.bench.peer import PeerConfig, build_workloads, compare, peer_version
from kvmesh.bench.peer_breakdown import STAGES, breakdown, prefill_spans
from kvmesh.bench.peer_drive import Timing, send, summary
from kvmesh.bench.peer_workloads import CONTEXT_ROOM, Call
from kvmesh.bench.serve import KEY, ServeBenchConfig, running_stack
from kvmesh.cli.main import app
from kvmesh.engine.presets import write_preset
from kvmesh.engine.tokenizer import Tokenizer
from openai import AsyncOpenAI
from typer.testing import CliRunner
from waits import until_sync


def test_a_peer_python_without_vllm_is_refused_naming_the_install(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-python"
    result = CliRunner().invoke(app, ["bench", "peer", "--json", "--peer-python", str(missing)])
    assert result.exit_code == 2
    assert "cannot import vllm" in result.output and "install.sh" in result.output
    assert peer_version(missing) is None


def test_workloads_are_seeded_and_every_prompt_fits_the_context(tmp_path: Path) -> None:
    model = write_preset(tmp_path / "agent", "agent")  # tiny widths, 32k positions: agent sessions fit
    cfg = PeerConfig(peer_python=Path(sys.executable), model_dir=model, out_dir=tmp_path, sessions=4,
                     calls=12, long_tokens=1500, batches=(1, 3))
    one, two = build_workloads(cfg), build_workloads(cfg)
    assert one == two  # byte-identical requests for both systems
    assert build_workloads(dataclasses.replace(cfg, seed=1)).chat != one.chat
    tok = Tokenizer.from_dir(model)
    context = one.notes["context"]
    calls = [c for s in one.agents for c in s.calls]
    assert calls and len(calls) == one.notes["agent_calls"]
    for c in calls:
        assert len(tok.encode(tok.apply_chat_template(list(c.messages)))) + c.max_tokens + CONTEXT_ROOM <= context
    for s in one.agents:  # each call extends the one before it: the agent's history grows
        for a, b in zip(s.calls, s.calls[1:], strict=False):
            assert b.messages[:len(a.messages)] == a.messages and len(b.messages) > len(a.messages)
    assert 1000 < len(tok.encode(tok.apply_chat_template(list(one.long.messages)))) <= 1500
    assert [len(v) for v in one.decode.values()] == [1, 3]
    times = [at for at, _ in one.chat]
    assert times == sorted(times) and len(times) == cfg.chat_users * cfg.chat_turns


def _timing(sent: float, gaps: list[float], cached: int = 0, error: str = "") -> Timing:
    t = Timing("w", sent, prompt_tokens=100, cached_tokens=cached, completion_tokens=len(gaps), error=error)
    at = sent
    for g in gaps:
        at += g
        t.token_times.append(at)
    return t


def test_figures_and_ratios() -> None:
    fast = [_timing(0.0, [0.1, 0.05, 0.05, 0.05], cached=50), _timing(1.0, [0.3, 0.05, 0.05, 0.05], cached=50)]
    slow = [_timing(0.0, [0.2, 0.1, 0.1, 0.1]), _timing(1.0, [0.6, 0.1, 0.1, 0.1]), _timing(2.0, [], error="boom")]
    a, b = summary(fast, 2.0), summary(slow, 4.0)
    assert a["errors"] == 0 and b["errors"] == 1 and b["requests"] == 3 and b["error_examples"] == ["boom"]
    assert a["ttft_s"]["mean"] == 0.2 and a["ttft_s"]["p50"] == 0.3 and a["cached_over_prompt"] == 0.5
    assert a["decode_tok_s_per_stream"] == 20.0 and b["decode_tok_s_per_stream"] == 10.0
    ratios = compare(b, a)  # kvmesh = the slow one here
    assert ratios["mean"] == 2.0 and ratios["decode_tok_s_per_stream"] == 0.5 and ratios["requests_per_s"] == 0.5


def test_the_breakdown_joins_the_prefill_workers_log_lines(tiny_model_dir: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    call = Call(({"role": "system", "content": "You are terse. " * 20}, {"role": "user", "content": "Go on."}), 8)

    async def two(url: str) -> list[Timing]:
        client = AsyncOpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=120)
        got = [await send(client, tiny_model_dir.name, "w", call) for _ in range(2)]
        await client.close()
        return got

    with running_stack(tiny_model_dir, ServeBenchConfig(model_dir=tiny_model_dir), True, _Quiet(),
                       {"KVMESH_LOG_LEVEL": "info"}, state) as url:
        timings = asyncio.run(two(url))
        # a request decoded on its prefill worker logs its line after its store, which follows the final event
        until_sync(lambda: len(prefill_spans(state / "logs")) == 2, 30, "both requests' prefill-worker lines")
        parts = breakdown(timings, state / "logs")
    assert all(t.ok for t in timings) and timings[1].cached_tokens > 0
    stages = parts["w"]
    assert stages["requests"] == 2  # both requests found by id in the prefill worker's log
    assert set(stages) - {"requests"} <= set(STAGES) and {"to_prefill", "engine", "token1_delivery"} <= set(stages)
    assert stages["engine"]["mean_s"] > 0 and stages["to_prefill"]["mean_s"] > 0


class _Quiet:
    def log(self, text: str) -> None:
        pass
