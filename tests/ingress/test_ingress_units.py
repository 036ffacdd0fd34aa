"""Ingress logic without a bus: keys and salts, rate limit, routing, prompts, in-order delivery, error bodies."""

from __future__ import annotations

import os
import stat
from datetime import UTC, datetime
from pathlib import Path

import pytest
from kvmesh.config import IngressSettings
from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.ingress.admission.auth import KeyRing, ensure_dev_key, parse_keys
from kvmesh.ingress.admission.limits import RateLimiter
from kvmesh.ingress.core.errors import ApiError, Dialect, ErrorKind
from kvmesh.ingress.core.prompt import PromptBuilder
from kvmesh.ingress.core.types import GenerationRequest, Usage
from kvmesh.ingress.routing.router import Router, home
from kvmesh.ingress.routing.workers import WorkerTable
from kvmesh.ingress.supervision.gateway import Gateway
from kvmesh.ingress.supervision.request_run import RequestRun
from kvmesh.protocol.messages import Heartbeat, Role
from kvmesh.protocol.serving import SamplingSpec, TokenEvent
from kvmesh.service.watch import Change, WorkerChange


def test_keys_and_salts(tmp_path: Path) -> None:
    assert parse_keys("k1:acme, k2:beta\n# note\nk3:acme") == {"k1": "acme", "k2": "beta", "k3": "acme"}
    with pytest.raises(ValueError):
        parse_keys("no-tenant")
    secret = bytes(range(32))
    ring = KeyRing.from_settings("k1:acme,k2:beta", None, tmp_path, secret)
    a, b = ring.lookup("k1"), ring.lookup("k2")
    assert a and b and a.tenant == "acme" and a.salt != b.salt and len(a.salt) == 64
    assert ring.lookup("k1").salt == KeyRing.from_settings("k9:acme", None, tmp_path, secret).lookup("k9").salt
    assert ring.lookup("k1x") is None and "k1" not in a.key_id
    other = KeyRing.from_settings("k1:acme", None, tmp_path, bytes(32))  # another deployment's secret
    assert other.lookup("k1").salt != a.salt


def test_dev_key_file(tmp_path: Path) -> None:
    path = tmp_path / "api_keys"
    key = ensure_dev_key(path)
    assert key and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert ensure_dev_key(path) is None  # made once
    assert KeyRing.from_settings(None, path, tmp_path, bytes(32)).lookup(key).tenant == "dev"


def test_rate_limiter_refills() -> None:
    now = [0.0]
    limiter = RateLimiter(rate_per_s=2.0, burst=3.0, clock=lambda: now[0])
    for _ in range(3):
        limiter.check("k")
    with pytest.raises(ApiError) as err:
        limiter.check("k")
    assert err.value.kind is ErrorKind.RATE_LIMIT and err.value.headers() == {"retry-after": "1"}
    limiter.check("other")  # per key
    now[0] = 0.5
    limiter.check("k")


def _hb(worker: str, role: Role, load: float = 0.0, capacity: float = 4.0) -> Heartbeat:
    return Heartbeat(worker_id=worker, role=role, load=load, capacity=capacity, started_at=datetime.now(UTC),
                     http_endpoint="http://127.0.0.1:1", seq=0, ttl_s=5.0)


def test_router_least_loaded_affinity_and_overload() -> None:
    table = WorkerTable()
    for w, load in (("p0", 3.0), ("p1", 1.0), ("p2", 2.0)):
        table.apply(WorkerChange(Change.UP, w, _hb(w, Role.PREFILL, load)))
    table.apply(WorkerChange(Change.UP, "d0", _hb("d0", Role.DECODE)))
    router = Router(table, overload_factor=1.0)
    assert router.pick(Role.PREFILL) == "p1"
    assert router.pick(Role.PREFILL, exclude=["p1"]) == "p2"
    key = next(k for k in (f"s{i}" for i in range(100)) if home(k, ["p0", "p1", "p2"]) == "p2")
    assert router.pick(Role.PREFILL, key) == "p2"  # affinity beats load
    for _ in range(3):
        table.acquire("p2")  # own in-flight: p2 is now (2 + 3) / 4 > 1.0 -> overloaded
    assert router.pick(Role.PREFILL, key) == "p1"
    gone = table.gone("p1")
    table.apply(WorkerChange(Change.DOWN, "p1", None))
    assert gone.is_set() and table.live(Role.PREFILL) == ["p0", "p2"]
    assert router.pick(Role.DECODE) == "d0" and router.pick(Role.DECODE, exclude=["d0"]) is None


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


def test_prompt_prefix_is_stable_and_answers_are_spliced(tokenizer: Tokenizer) -> None:
    prompts = PromptBuilder(tokenizer, memory_capacity=8)
    turn1 = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hello there"}]
    first = prompts.chat("t", turn1)
    answer = "sunny skies"
    alt = [i for ch in answer for i in tokenizer.encode(ch)]  # other ids with the same text
    assert tokenizer.decode(alt) == answer and alt != tokenizer.encode(answer)
    prompts.remember_answer("t", answer, [*alt, *tokenizer.eos_token_ids])
    turn2 = [*turn1, {"role": "assistant", "content": answer}, {"role": "user", "content": "and then?"}]
    second = prompts.chat("t", turn2)
    assert second[: len(first)] == first
    assert second[len(first): len(first) + len(alt)] == alt  # the generated ids, not a re-tokenization
    assert prompts.chat("other-tenant", turn2)[len(first): len(first) + len(alt)] != alt
    cut = tokenizer.encode("cut by a stop string")
    prompts.remember_answer("t", "cut by a stop string", [*cut, *tokenizer.encode(" STOP")])
    assert prompts.memory.recall("t", "cut by a stop string") == tuple(cut)  # the stop string's ids dropped
    prompts.remember_answer("t", "unrelated text", tokenizer.encode("something else entirely"))
    assert prompts.memory.recall("t", "unrelated text") is None


def _run(tokenizer: Tokenizer) -> RequestRun:
    gw = Gateway(None, None, WorkerTable(), IngressSettings(), tokenizer.decode)  # type: ignore[arg-type]
    req = GenerationRequest("r1", "t", "00", [5, 6], SamplingSpec(max_tokens=8))
    return RequestRun(gw, req, Usage())


def test_delivery_in_order_without_duplicates(tokenizer: Tokenizer) -> None:
    run = _run(tokenizer)

    def ev(seq: int, ids: list[int], finished: bool = False) -> TokenEvent:
        return TokenEvent(request_id="r1", seq=seq, token_ids=ids, text=tokenizer.decode(ids), finished=finished,
                          prompt_tokens=2, cached_tokens=0)

    out: list[TokenEvent] = []
    out += run._accept(ev(0, [10]))
    out += run._accept(ev(3, [13]))  # ahead: buffered
    assert [e.seq for e in out] == [0]
    out += run._accept(ev(1, [11, 12]))  # fills the gap: 1..2 then the buffered 3
    out += run._accept(ev(1, [11, 12]))  # duplicate (a retried attempt): dropped
    out += run._accept(ev(2, [12, 13, 14, 15], finished=True))  # partly seen: only 14, 15 are new
    assert [t for e in out for t in e.token_ids] == [10, 11, 12, 13, 14, 15]
    assert out[-1].finished and out[-1].seq == 4 and out[-1].text == tokenizer.decode([14, 15])
    assert run.generated == [10, 11, 12, 13, 14, 15] and run.usage.prompt_tokens == 2


def test_error_bodies_per_dialect() -> None:
    busy = ApiError(ErrorKind.OVERLOADED, "busy")
    assert busy.status(Dialect.OPENAI) == 503 and busy.status(Dialect.ANTHROPIC) == 529
    assert busy.body(Dialect.ANTHROPIC) == {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}
    bad = ApiError(ErrorKind.INVALID_REQUEST, "nope", param="n")
    assert bad.body(Dialect.OPENAI) == {"error": {"message": "nope", "type": "invalid_request_error",
                                                  "param": "n", "code": None}}
    assert ApiError(ErrorKind.REQUEST_TOO_LARGE, "big").status(Dialect.ANTHROPIC) == 413


def test_tool_turns_reach_the_template(tokenizer: Tokenizer) -> None:
    from kvmesh.ingress.dialects.openai.models import ChatCompletionRequest

    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": "list the files"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "list_dir", "arguments": "{\"path\": \"/srv\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "notes.txt"},
    ]})
    messages = [m.flat() for m in body.messages]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"path": "/srv"}
    text = tokenizer.decode(PromptBuilder(tokenizer, 4).chat("t", messages), skip_special_tokens=False)
    assert "list_dir" in text and "/srv" in text and "notes.txt" in text
