"""Fuzz a running ingress from its own OpenAPI document (schemathesis), and count what came back.

`fuzz(base_url, key, cfg)` reads /openapi.json with the key, then for every
operation (both dialects) sends `cfg.max_examples` positive and as many
negative cases, built by schemathesis from the request schemas, with valid
auth. Half of the bodies that name a model get the served one (and a small
token budget), so requests get past the model check into prompt building,
budgets and generation. Nothing is asserted while it runs; the report counts
examples, statuses, 5xx responses, and 4xx bodies not in the route's dialect
error format (OpenAI `{"error": {"message", "type"}}`, Anthropic
`{"type": "error", "error": {"type", "message"}}`), with the first few
offenders to reproduce. tests/ingress/test_fuzz.py runs a small bounded
pass; `python -m kvmesh.bench.fuzz_ingress` a longer one (needs the `test` extra):

    python -m kvmesh.bench.fuzz_ingress --examples 200 --seed 1            # a stack of its own (tiny model)
    python -m kvmesh.bench.fuzz_ingress --url http://127.0.0.1:8000 --key sk-...   # an ingress already up
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from kvmesh.ingress.core.errors import Dialect, dialect_of

TOKEN_CAP = 4  # completion tokens of a fuzzed request that names the served model: keeps generation short
AUTH_HEADERS = ("authorization", "x-api-key")
_BUDGET_KEYS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


@dataclass(frozen=True, slots=True)
class FuzzConfig:
    max_examples: int = 10  # per operation and generation mode (positive, negative)
    seed: int | None = None  # None: derandomized (the same cases every run, as CI wants)
    timeout_s: float = 120.0  # one request


@dataclass(slots=True)
class FuzzReport:
    examples: int = 0
    server_errors: int = 0  # responses >= 500
    timeouts: int = 0  # no response within FuzzConfig.timeout_s (a request the stack never finished)
    bad_error_bodies: int = 0  # 4xx/5xx bodies not in the dialect's error format
    operations: dict[str, int] = field(default_factory=dict)  # "POST /v1/messages" -> examples sent
    statuses: dict[str, int] = field(default_factory=dict)  # "400" -> count
    failures: list[dict[str, Any]] = field(default_factory=list)  # the first few offenders: request, body, response


def error_problem(path: str, status: int, body: bytes) -> str | None:
    """Why an error response's body is not the dialect's error format (None when it is)."""
    try:
        doc = json.loads(body)
    except ValueError:
        return "not JSON"
    if not isinstance(doc, dict) or not isinstance(doc.get("error"), dict):
        return "no error object"
    err = doc["error"]
    if dialect_of(path) is Dialect.ANTHROPIC:
        ok = doc.get("type") == "error" and isinstance(err.get("type"), str) and isinstance(err.get("message"), str)
        return None if ok else "not {type: error, error: {type, message}}"
    ok = isinstance(err.get("message"), str) and isinstance(err.get("type"), str)
    return None if ok else "not {error: {message, type}}"


def aim(body: Any, model: str) -> Any:
    """A body naming the served model with a short budget (dicts only; anything else is sent as generated)."""
    if not isinstance(body, dict):
        return body
    body = {**body, "model": model}
    for key in _BUDGET_KEYS:
        if isinstance(body.get(key), int) and not isinstance(body[key], bool):
            body[key] = max(1, min(body[key], TOKEN_CAP))
    if not any(k in body for k in _BUDGET_KEYS):
        body["max_tokens"] = TOKEN_CAP
    return body


def _record(report: FuzzReport, case: Any, status: int | None, content: bytes) -> None:
    """Count one exchange; `status` None: it timed out."""
    report.examples += 1
    report.statuses[str(status)] = report.statuses.get(str(status), 0) + 1
    problem = error_problem(case.path, status, content) if status and status >= 400 else None
    if status and status >= 500:
        report.server_errors += 1
    if problem is not None:
        report.bad_error_bodies += 1
    if (status is None or status >= 500 or problem) and len(report.failures) < 10:
        # the request as sent, not schemathesis's curl line: that one masks fields named like secrets (max_tokens)
        sent = json.dumps(case.body, default=str)[:2000] if isinstance(case.body, dict | list) else repr(case.body)
        report.failures.append({"status": status, "problem": problem, "request": f"{case.method} {case.formatted_path}",
                                "query": case.query, "body": sent, "response": content[:500].decode("utf-8", "replace")})


def fuzz(base_url: str, key: str, cfg: FuzzConfig = FuzzConfig()) -> FuzzReport:
    """Fuzz every operation of the ingress at `base_url` with API key `key`; see the module docstring."""
    import requests  # what schemathesis sends with
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as seeded
    from hypothesis import strategies as st
    from hypothesis.errors import Unsatisfiable

    auth = {"authorization": f"Bearer {key}"}
    doc = httpx.get(f"{base_url}/openapi.json", headers=auth, timeout=30).raise_for_status().json()
    model = httpx.get(f"{base_url}/v1/models", headers=auth, timeout=30).json()["data"][0]["id"]
    schema = schemathesis.openapi.from_dict(doc)
    report = FuzzReport()
    for result in schema.get_all_operations():
        op = result.ok()
        label = f"{op.method.upper()} {op.path}"
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            @settings(max_examples=cfg.max_examples, derandomize=cfg.seed is None, database=None, deadline=None,
                      phases=[Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(mode), served=st.booleans())
            def one(case: Any, served: bool) -> None:
                if served and isinstance(case.body, dict):
                    case.body = aim(case.body, model)
                # schemathesis fills the security schemes' headers with made-up keys: the valid one replaces them
                headers = {k: v for k, v in (case.headers or {}).items() if k.lower() not in AUTH_HEADERS}
                case.headers = {**headers, **auth}
                report.operations[label] = report.operations.get(label, 0) + 1
                try:
                    response = case.call(base_url=base_url, timeout=cfg.timeout_s)
                except requests.Timeout:
                    report.timeouts += 1
                    _record(report, case, None, b"")
                    return
                _record(report, case, response.status_code, response.content)

            try:
                (seeded(cfg.seed)(one) if cfg.seed is not None else one)()
            except Unsatisfiable:  # nothing to make invalid (a route without parameters or body): no negatives
                pass
    return report


@contextmanager
def own_stack(say: Any) -> Iterator[tuple[str, str]]:
    """(ingress URL, API key) of a `kvmesh up` stack with the tiny preset, in a temp dir; always `kvmesh down`."""
    from kvmesh.net import free_port

    bindir = Path(sys.executable).parent
    key = "sk-fuzz"
    with tempfile.TemporaryDirectory(prefix="kvmesh-fuzz-") as tmp:
        model = Path(tmp) / "tiny"
        subprocess.run([str(bindir / "kvmesh"), "model", "init", "--preset", "tiny", "--out", str(model)],
                       check=True, capture_output=True)
        port = free_port()
        env = {**os.environ, "KVMESH_API_KEYS": f"{key}:fuzz", "KVMESH_INGRESS__PORT": str(port),
               "KVMESH_LOG_LEVEL": "warning", "KVMESH_INGRESS__RATE_LIMIT_PER_S": "100000",
               "KVMESH_INGRESS__RATE_LIMIT_BURST": "100000"}
        state = Path(tmp) / "state"
        args = [str(bindir / "kvmesh"), "up", "--detach", "--model", str(model), "--state-dir", str(state),
                "--nats-port", "0", "--nats-monitor-port", "0", "--s3-port", "0", "--timeout", "900"]
        say("starting a stack")
        try:
            up = subprocess.run(args, env=env, capture_output=True, text=True, timeout=960)
            if up.returncode != 0:
                raise RuntimeError(f"kvmesh up failed ({up.returncode}): {up.stderr[-2000:]}")
            yield f"http://127.0.0.1:{port}", key
        finally:
            subprocess.run([str(bindir / "kvmesh"), "down", "--state-dir", str(state)], env=env,
                           capture_output=True, timeout=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running ingress (default: start a stack of its own)")
    p.add_argument("--key", help="an API key of that ingress")
    p.add_argument("--examples", type=int, default=200, help="per operation and generation mode")
    p.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: derandomized)")
    args = p.parse_args(argv)
    cfg = FuzzConfig(max_examples=args.examples, seed=args.seed)

    def say(text: str) -> None:
        print(text, file=sys.stderr)

    if args.url:
        report = fuzz(args.url.rstrip("/"), args.key or "", cfg)
    else:
        with own_stack(say) as (url, key):
            report = fuzz(url, key, cfg)
    print(json.dumps({"config": asdict(cfg), **asdict(report), "status_classes": _classes(report.statuses)}))
    return 1 if report.server_errors or report.bad_error_bodies or report.timeouts else 0


def _classes(statuses: dict[str, int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for status, n in statuses.items():
        cls = "timeout" if status == "None" else status[0] + "xx"
        out[cls] = out.get(cls, 0) + n
    return out


if __name__ == "__main__":
    raise SystemExit(main())
