"""`kvmesh generate` end to end, as a subprocess on the tiny checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SHARED = "You are a careful assistant. Answer briefly and precisely, citing the source. "


def kvmesh(*args: str) -> subprocess.CompletedProcess:
    code = "from kvmesh.cli.main import app; app()"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)


def test_second_prompt_hits_and_matches_cache_off(tiny_model_dir: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    lines = [{"prompt": SHARED + "What is the capital of France?"}, {"prompt": SHARED + "Who wrote Hamlet?"}]
    prompts.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    common = ["generate", "--model", str(tiny_model_dir), "--prompts-file", str(prompts), "--max-tokens", "8", "--block-size", "4"]
    on = kvmesh(*common)
    off = kvmesh(*common, "--no-prefix-cache")
    assert on.returncode == 0, on.stderr
    assert off.returncode == 0, off.stderr
    got_on = [json.loads(x) for x in on.stdout.splitlines()]
    got_off = [json.loads(x) for x in off.stdout.splitlines()]
    assert len(got_on) == len(got_off) == 2
    assert got_on[0]["cached_tokens"] == 0 and got_on[1]["cached_tokens"] > 0
    assert all(o["cached_tokens"] == 0 for o in got_off)
    assert [o["token_ids"] for o in got_on] == [o["token_ids"] for o in got_off]
    assert all(len(o["token_ids"]) <= 8 and o["prompt_tokens"] > 8 for o in got_on)
    assert got_on[0]["text"] == got_off[0]["text"]


def test_prompt_ids_and_bad_lines(tiny_model_dir: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_ids": [5, 6, 7]}\n{"prompt_ids": [1, "x"]}\n')
    res = kvmesh("generate", "--model", str(tiny_model_dir), "--prompts-file", str(bad))
    assert res.returncode == 2 and f"{bad}:2:" in res.stderr and "prompt_ids" in res.stderr
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt_ids": [5, 6, 7, 8, 9]}\n\n{"prompt": "plain text"}\n')
    res = kvmesh("generate", "--model", str(tiny_model_dir), "--prompts-file", str(good), "--max-tokens", "3")
    assert res.returncode == 0, res.stderr
    out = [json.loads(x) for x in res.stdout.splitlines()]
    assert out[0]["prompt_tokens"] == 5 and len(out[0]["token_ids"]) == 3 and len(out) == 2
