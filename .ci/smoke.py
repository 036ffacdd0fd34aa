"""Every `kvmesh` command from the README's main install: each command's --help, then the short form of each
command family (or its documented refusal), run as a user would (the console script, in a scratch dir).

Run with the venv's python before the test tools are added (`.ci/run`): a command that needs something the
main install lacks fails here. A case fails on an unexpected exit code, or when its output holds a traceback or
an import error, whatever its exit code. Ends with the plain `N passed, N failed` line.

    .venv/bin/python .ci/smoke.py [--only NAME ...]
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KVMESH = str(Path(sys.executable).parent / "kvmesh")
WORKLOADS = ROOT.parent / "shared" / "workloads"
BAD_OUTPUT = ("Traceback (most recent call last)", "ModuleNotFoundError", "ImportError")


@dataclass
class Case:
    name: str
    argv: list[str]
    timeout_s: float = 120.0
    codes: tuple[int, ...] = (0,)  # exit codes that pass (a documented refusal has its own)
    must_say: str = ""  # text the output must hold (a refusal's reason)
    stdin: str = ""
    env: dict[str, str] = field(default_factory=dict)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command_paths() -> list[list[str]]:
    """Every command and subcommand of the `kvmesh` app, as argv paths (click's tree under typer)."""
    import typer
    from kvmesh.cli.main import app

    paths: list[list[str]] = []

    def walk(cmd, path: list[str]) -> None:  # typer's click: a group has `commands`
        paths.append(path)
        if hasattr(cmd, "commands"):
            for name, sub in cmd.commands.items():
                walk(sub, [*path, name])

    walk(typer.main.get_command(app), [])
    return paths


def help_failures() -> tuple[int, list[str]]:
    """Each command's --help, in this process (the console script's app, as typer runs it): (passed, failed)."""
    from kvmesh.cli.main import app
    from typer.testing import CliRunner

    passed, failed = 0, []
    for path in command_paths():
        got = CliRunner().invoke(app, [*path, "--help"])
        name = "help " + (" ".join(path) or "kvmesh")
        if got.exit_code != 0 or got.exception is not None or any(b in got.output for b in BAD_OUTPUT):
            print(f"FAIL {name}: exit {got.exit_code} {got.exception!r}\n{got.output[-1500:]}", flush=True)
            failed.append(name)
        else:
            passed += 1
    print(f"ok   --help of {passed} commands", flush=True)
    return passed, failed


def cases(tmp: Path) -> list[Case]:
    k = KVMESH
    tiny, trace, prompts = tmp / "tiny", tmp / "trace.jsonl", tmp / "prompts.jsonl"
    kv, kv2 = tmp / "kv.safetensors", tmp / "kv-hnd.safetensors"
    prompts.write_text(json.dumps({"prompt": "The capital of France is"}) + "\n"
                       + json.dumps({"prompt": "Agents re-send long, growing contexts every turn."}) + "\n")
    state = tmp / "state"
    ports = ["--nats-port", str(free_port()), "--nats-monitor-port", str(free_port()), "--s3-port", str(free_port())]
    api = {"KVMESH_INGRESS__PORT": str(free_port()), "KVMESH_STATE_DIR": str(state)}
    return [
        Case("version", [k, "version"]),
        Case("model init", [k, "model", "init", "--preset", "tiny", "--out", str(tiny)]),
        Case("model info", [k, "model", "info", str(tiny)]),
        Case("generate", [k, "generate", "--model", str(tiny), "--prompts-file", str(prompts), "--max-tokens", "4"]),
        Case("kv export", [k, "kv", "export", "--model", str(tiny), "--prompts-file", str(prompts), "--out", str(kv)]),
        Case("kv convert", [k, "kv", "convert", str(kv), str(kv2), "--layout", "HND"]),
        Case("kv import (no S3 server: a clear error)", [k, "kv", "import", str(kv), "--namespace", "smoke",
                                                         "--endpoint", f"127.0.0.1:{free_port()}"],
             codes=(1, 2), must_say="S3"),
        Case("trace from-trajectories", [k, "trace", "from-trajectories", str(WORKLOADS / "swe-agent"),
                                         "--out", str(trace), "--sessions", "3"]),
        Case("sim", [k, "sim", "--trace", str(trace), "--l1-fraction", "0.1"]),
        Case("chaos list", [k, "chaos", "list"]),
        Case("chaos run overload", [k, "chaos", "run", "overload", "--nats-nodes", "1", "--duration", "2",
                                    "--sessions", "1", "--json"], 600),
        # the local stack with its default engine (vLLM, installed by the main install), a chat turn, status
        Case("up (default engine)", [k, "up", "--detach", *ports], 960, env=api),
        Case("status", [k, "status"], 60, env=api),
        Case("chat", [k, "chat", "--max-tokens", "8"], 300, stdin="What is the capital of France?\n", env=api),
        Case("trace record", [k, "trace", "record", "--out", str(tmp / "served.jsonl")], 60, env=api),
        Case("report cost", [k, "report", "cost", "--trace", str(tmp / "served.jsonl")], 60, env=api),
        Case("down", [k, "down"], 120, env=api),
        # benches: the smallest run of each
        Case("bench engine", [k, "bench", "engine", "--model", str(tiny), "--prompt-tokens", "32", "--decode-tokens",
                              "4", "--batch-sizes", "1", "--repeats", "1", "--json"], 300),
        Case("bench tiers", [k, "bench", "tiers", "--blocks", "8", "--no-restore", "--json"], 300),
        Case("bench bus", [k, "bench", "bus", "--messages", "50", "--json"], 300),
        Case("bench index", [k, "bench", "index", "--blocks", "256", "--lookups", "20", "--json"], 300),
        Case("bench datapath", [k, "bench", "datapath", "--context", "1024", "--turns", "2", "--repeats", "1",
                                "--json"], 300),
        Case("bench constrained", [k, "bench", "constrained", "--preset", "tiny", "--batch-sizes", "1",
                                   "--decode-tokens", "8", "--repeats", "1", "--json"], 300),
        Case("bench grammar-libs", [k, "bench", "grammar-libs", "--vocab-sizes", "512", "--json"], 300),
        Case("bench live-belady", [k, "bench", "live-belady", "--records", "100", "--json"], 300),
        Case("bench fleet", [k, "bench", "fleet", "--workers", "2", "--requests", "20", "--json"], 300),
        Case("bench heartbeat-watch", [k, "bench", "heartbeat-watch", "--workers", "2", "--window-s", "1",
                                       "--json"], 300),
        Case("bench token-events", [k, "bench", "token-events", "--tokens", "8", "--json"], 300),
        Case("bench l3-gc", [k, "bench", "l3-gc", "--objects", "200", "--json"], 300),
        Case("bench serve", [k, "bench", "serve", "--sessions", "1", "--turns", "2", "--max-tokens", "4",
                             "--concurrency", "1", "--json"], 600),
        Case("bench agents", [k, "bench", "agents", "--sessions", "1", "--max-steps", "2", "--json"], 600),
        Case("bench soak", [k, "bench", "soak", "--duration-s", "10", "--sessions", "1", "--sample-every-s", "2",
                            "--json"], 600),
        Case("bench handoff", [k, "bench", "handoff", "--turns", "1", "--min-first-tokens", "64", "--l3", "off",
                               "--json"], 600),
        Case("bench peer (no vLLM at --peer-python: the refusal)", [k, "bench", "peer", "--peer-python",
                                                                   str(tmp / "none")], codes=(2,),
             must_say="cannot import vllm"),
        Case("bench connector (no vLLM at --peer-python: the refusal)", [k, "bench", "connector", "--peer-python",
                                                                        str(tmp / "none")], codes=(2,),
             must_say="needs a Python with vLLM"),
    ]


def run(case: Case, cwd: Path) -> str:
    """'' when the case passes, else why not."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")} | case.env
    try:
        got = subprocess.run(case.argv, cwd=cwd, env=env, input=case.stdin, capture_output=True, text=True,
                             timeout=case.timeout_s)
    except subprocess.TimeoutExpired:
        return f"no exit within {case.timeout_s:.0f}s"
    text = got.stdout + got.stderr
    bad = [b for b in BAD_OUTPUT if b in text]
    if bad or got.returncode not in case.codes or case.must_say not in text:
        return f"exit {got.returncode}{', ' + ', '.join(bad) if bad else ''}:\n{text[-2500:]}"
    return ""


def main(argv: list[str]) -> int:
    only = set(argv[argv.index("--only") + 1:]) if "--only" in argv else set()
    passed, failed = (0, []) if only else help_failures()
    with tempfile.TemporaryDirectory(prefix="kvmesh-smoke-") as scratch:
        tmp = Path(scratch)
        try:
            for case in cases(tmp):
                if only and not any(case.name.startswith(o) for o in only):
                    continue
                start = time.monotonic()
                why = run(case, tmp)
                print(f"{'ok  ' if not why else 'FAIL'} {case.name} ({time.monotonic() - start:.1f}s)", flush=True)
                if why:
                    print("     " + why.replace("\n", "\n     "), flush=True)
                    failed.append(case.name)
                else:
                    passed += 1
        finally:  # a stack left by a failed case
            subprocess.run([KVMESH, "down", "--state-dir", str(tmp / "state")], capture_output=True, timeout=120)
    print(f"{passed} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
