"""End to end: a few chat turns through the OpenAI SDK on `kvmesh up`, then `kvmesh report cost --json`
reads them back from the stack's TRAFFIC stream (as the admin NATS user) and prices what was served."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from kvmesh.net import free_port
from openai import OpenAI

KEY = "sk-kvmesh-report-test"
SYSTEM = "You are a careful assistant. Answer every question about the weather, trains and tea in full detail."
QUESTIONS = ("Is it raining?", "Will the train be late?", "Which tea goes with rain?")


def _report_of(stack, want: int, deadline_s: float = 90) -> dict:
    """The report once the stream holds `want` records (each is published after its answer was delivered)."""
    end = time.monotonic() + deadline_s
    while True:
        out = stack.cli("report", "cost", "--json", timeout=60)
        if out.returncode == 0 and json.loads(out.stdout)["measured"]["requests"] >= want:
            return json.loads(out.stdout)
        assert time.monotonic() < end, f"the stream never held {want} records: {out.stdout[-400:]} {out.stderr[-400:]}"


@pytest.mark.slow
def test_report_cost_reads_the_served_traffic(stack, tiny_model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    stack.env.update(KVMESH_INGRESS__PORT=str(port), KVMESH_API_KEYS=f"{KEY}:tenant-a")
    out = stack.cli(*stack.up_args("--detach", "--model", str(tiny_model_dir), "--timeout", "240"), timeout=300)
    assert out.returncode == 0, out.stderr
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=120)
        messages = [{"role": "system", "content": SYSTEM}]
        usages = []
        for question in QUESTIONS:  # one growing conversation: each turn re-sends the last one's prefix
            messages.append({"role": "user", "content": question})
            answer = client.chat.completions.create(model=tiny_model_dir.name, messages=messages, max_tokens=6,
                                                    temperature=0, extra_headers={"x-session-id": "chat-1"})
            messages.append({"role": "assistant", "content": answer.choices[0].message.content})
            usages.append(answer.usage)
        report = _report_of(stack, len(QUESTIONS))
        m = report["measured"]
        assert m["requests"] == len(QUESTIONS)
        assert m["tokens_in"] == sum(u.prompt_tokens for u in usages)
        assert m["tokens_out"] == sum(u.completion_tokens for u in usages)
        assert m["cached_tokens"] == sum(u.prompt_tokens_details.cached_tokens for u in usages) > 0
        assert (m["sessions"], m["turns"]["mean"]) == (1, len(QUESTIONS))
        assert sum(m["tier_tokens"].values()) == m["cached_tokens"]
        assert report["recommendation"] in ("hosted", "self_built", "kvmesh_cross_turn")
        built = report["self_built"]
        base, kv = built["options"]
        # one growing conversation in a large L1: the baseline's LRU keeps every earlier prompt, and kvmesh also
        # reuses the blocks each answer wrote, which the baseline (it replays prompts only) never sees
        assert kv["prefill_gpu_s"] <= base["prefill_gpu_s"] < built["no_cache"]["prefill_gpu_s"]
        assert [s["source"] for s in built["savings"]] == ["l1_prefix_caching", "kvmesh_on_top"]
        page = stack.cli("report", "cost", "--html", str(tmp_path / "report.html"), timeout=60)
        assert page.returncode == 0, page.stderr
        assert (tmp_path / "report-hit-rate.png").exists() and (tmp_path / "report-cost.png").exists()
    finally:
        assert stack.cli("down").returncode == 0
