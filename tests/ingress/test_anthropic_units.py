"""The Anthropic dialect without a stack: body -> conversation, breakpoint rules and positions, usage, stop reasons."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.ingress.core.errors import ApiError, ErrorKind
from kvmesh.ingress.core.prompt import PromptBuilder
from kvmesh.ingress.dialects.anthropic.cache_control import (
    Placed,
    cache_usage,
    check_breakpoints,
    pins,
    place,
)
from kvmesh.ingress.dialects.anthropic.models import MessagesRequest
from kvmesh.ingress.dialects.anthropic.routes import stop_reason
from kvmesh.ingress.named_caches.api import CreateCacheRequest, parse_ttl

EPH = {"type": "ephemeral"}


def body(**kw) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 8, **kw})


@pytest.fixture(scope="module")
def prompts(tiny_model_dir: Path) -> PromptBuilder:
    return PromptBuilder(Tokenizer.from_dir(tiny_model_dir), 64)


def test_blocks_flatten_in_order() -> None:
    req = body(system=[{"type": "text", "text": "sys A"}, {"type": "text", "text": "sys B"}],
               messages=[{"role": "user", "content": "list files"},
                         {"role": "assistant", "content": [
                             {"type": "text", "text": "I will call ls."},
                             {"type": "tool_use", "id": "t1", "name": "ls", "input": {"path": "."}}]},
                         {"role": "user", "content": [
                             {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "a.py"}]},
                             {"type": "text", "text": "and now?"}]}])
    conv, bps = req.conversation()
    assert bps == []
    assert [m["role"] for m in conv.messages] == ["system", "user", "assistant", "tool", "user"]
    assert conv.messages[0]["content"] == "sys A\nsys B"
    assert conv.messages[2] == {"role": "assistant", "content": "I will call ls.", "tool_calls": [
        {"id": "t1", "type": "function", "function": {"name": "ls", "arguments": {"path": "."}}}]}
    assert conv.messages[3] == {"role": "tool", "content": "a.py", "tool_call_id": "t1"}


def test_tool_conversation_renders_as_in_the_openai_dialect(prompts: PromptBuilder) -> None:
    from kvmesh.ingress.dialects.openai.models import ChatCompletionRequest

    anth = body(system="sys", tools=[{"name": "ls", "description": "List.", "input_schema": {"type": "object"}}],
                messages=[{"role": "user", "content": "list"},
                          {"role": "assistant", "content": [
                              {"type": "text", "text": "Calling."},
                              {"type": "tool_use", "id": "c1", "name": "ls", "input": {"path": "."}}]},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "a.py"}]}])
    oai = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "list"},
        {"role": "assistant", "content": "Calling.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": '{"path": "."}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.py"}],
        "tools": [{"type": "function", "function": {"name": "ls", "description": "List.",
                                                    "parameters": {"type": "object"}}}]})
    conv, _ = anth.conversation()
    assert prompts.render(conv.messages, conv.tools) == prompts.render([m.flat() for m in oai.messages], oai.tools)
    assert '{"name": "ls", "parameters": {"path": "."}}' in prompts.render(conv.messages, conv.tools)


def test_breakpoints_in_cache_order_and_limits() -> None:
    tools = [{"name": "ls", "input_schema": {"type": "object"}, "cache_control": {**EPH, "ttl": "1h"}}]
    req = body(tools=tools, system=[{"type": "text", "text": "s", "cache_control": EPH}],
               messages=[{"role": "user", "content": [{"type": "text", "text": "u", "cache_control": EPH}]}])
    _, bps = req.conversation()
    assert [b.ttl for b in bps] == ["1h", "5m", "5m"]
    check_breakpoints(bps)
    # 1h after 5m is Anthropic's 400
    late = body(system=[{"type": "text", "text": "s", "cache_control": EPH}],
                messages=[{"role": "user", "content": [{"type": "text", "text": "u",
                                                         "cache_control": {**EPH, "ttl": "1h"}}]}])
    with pytest.raises(ApiError) as err:
        check_breakpoints(late.conversation()[1])
    assert err.value.kind is ErrorKind.INVALID_REQUEST
    five = body(messages=[{"role": "user", "content": [{"type": "text", "text": str(i), "cache_control": EPH}
                                                         for i in range(5)]}])
    with pytest.raises(ApiError, match="maximum of 4"):
        check_breakpoints(five.conversation()[1])
    # the top-level cache_control marks the last block (one more breakpoint)
    top = body(cache_control=EPH, messages=[{"role": "user", "content": "hi"}])
    assert len(top.conversation()[1]) == 1


def test_breakpoint_positions_are_exact_token_prefixes(prompts: PromptBuilder) -> None:
    system_text = "You are an agent that edits repositories. " * 6
    req = body(system=[{"type": "text", "text": system_text, "cache_control": EPH}],
               messages=[{"role": "user", "content": "first question"},
                         {"role": "assistant", "content": "an answer"},
                         {"role": "user", "content": [{"type": "text", "text": "second question",
                                                       "cache_control": EPH}]}])
    conv, bps = req.conversation()
    rendered = prompts.render(conv.messages, conv.tools)
    ids = prompts.tokenize("t", rendered, conv.messages)
    placed = place(prompts, "t", conv, rendered, ids, bps)
    sys_end, last_end = placed[0].num_tokens, placed[1].num_tokens
    assert 0 < sys_end < last_end < len(ids)
    text = prompts.tokenizer.decode(ids[:sys_end], skip_special_tokens=False)
    # a block that ends its message takes the end-of-turn token with it (the cut renders the same text)
    assert text.endswith(system_text + "<|eot_id|>")
    upto = prompts.tokenizer.decode(ids[:last_end], skip_special_tokens=False)
    assert upto.endswith("second question<|eot_id|>")
    # the same prefix through the builder used by every request: same ids, so pins land on real blocks
    assert prompts.chat("t", conv.messages, conv.tools) == ids
    assert [p.num_tokens for p in pins(placed)] == [sys_end, last_end]


def test_usage_arithmetic() -> None:
    bps = [Placed(100, "1h"), Placed(300, "5m")]
    cold = cache_usage(400, 0, bps)
    assert (cold.ephemeral_1h_input_tokens, cold.ephemeral_5m_input_tokens, cold.input_tokens) == (100, 200, 100)
    assert cold.cache_creation_input_tokens == 300 and cold.cache_read_input_tokens == 0
    warm = cache_usage(400, 160, bps)
    assert (warm.ephemeral_1h_input_tokens, warm.ephemeral_5m_input_tokens, warm.input_tokens) == (0, 140, 100)
    hit = cache_usage(420, 400, bps)
    assert hit.cache_creation_input_tokens == 0 and hit.input_tokens == 20 and hit.cache_read_input_tokens == 400
    plain = cache_usage(50, 32, [])
    assert plain.to_dict(3) == {"input_tokens": 18, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 32,
                                "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0},
                                "output_tokens": 3}


def test_stop_reason() -> None:
    assert stop_reason("length", "abc", "abc", ["x"]) == ("max_tokens", None)
    assert stop_reason("stop", "abc", "abc", []) == ("end_turn", None)
    assert stop_reason("stop", "ab", "abEND", ["zz", "END"]) == ("stop_sequence", "END")
    assert stop_reason("stop", "ab", "abXYEND", ["END", "XY"]) == ("stop_sequence", "XY")


def test_bad_bodies_are_validation_errors() -> None:
    for bad in ({"messages": []}, {"messages": [{"role": "system", "content": "x"}]},
                {"messages": [{"role": "user", "content": "x"}], "temperature": 1.5},
                {"messages": [{"role": "user", "content": [{"type": "text", "text": "x",
                                                            "cache_control": {"type": "ephemeral", "ttl": "2h"}}]}]}):
        with pytest.raises(ValueError):
            body(**bad)
    with pytest.raises(ValueError):
        MessagesRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}]})  # max_tokens


def test_named_cache_ttl_and_body() -> None:
    assert parse_ttl("90s") == 90 and parse_ttl("5m") == 300 and parse_ttl("1h") == 3600
    assert parse_ttl("30d") == 30 * 86400
    for bad in ("", "5", "1w", "m5"):
        with pytest.raises(ValueError):
            parse_ttl(bad)
    assert CreateCacheRequest.model_validate({"model": "m", "system": "s", "ttl": "7d"}).ttl_s() == 7 * 86400
    for ttl in ({"ttl": "30s"}, {"ttl": "31d"}, {"ttl_seconds": 59}):
        with pytest.raises(ApiError):
            CreateCacheRequest.model_validate({"model": "m", "system": "s", **ttl}).ttl_s()
    with pytest.raises(ValueError, match="system prompt or messages"):
        CreateCacheRequest.model_validate({"model": "m"})


def test_common_prefix_bisects() -> None:
    from kvmesh.ingress.dialects.anthropic.cache_control import _common_prefix

    assert [_common_prefix(a, b) for a, b in (("abc", "abd"), ("", "x"), ("abc", "abc"), ("abc", "abcd"),
                                               ("x", "y"))] == [2, 0, 3, 3, 0]
    big = "y" * 1_000_003
    assert _common_prefix(big + "a", big + "b") == len(big)


def test_breakpoint_inside_a_message_stops_before_the_next_block(prompts: PromptBuilder) -> None:
    req = body(messages=[{"role": "user", "content": [
        {"type": "text", "text": "The first block of the question.", "cache_control": EPH},
        {"type": "text", "text": "The second block."}]}])
    conv, bps = req.conversation()
    rendered = prompts.render(conv.messages, conv.tools)
    ids = prompts.tokenize("t", rendered, conv.messages)
    (at,) = place(prompts, "t", conv, rendered, ids, bps)
    head = prompts.tokenizer.decode(ids[: at.num_tokens], skip_special_tokens=False)
    assert "The first block" in head and "second" not in head
    assert head.rstrip().endswith("question.") or head.endswith("question")


def test_assistant_prefill_continues_its_text(prompts: PromptBuilder) -> None:
    from kvmesh.ingress.dialects.anthropic.routes import render_prompt

    conv, _ = body(messages=[{"role": "user", "content": "Reply in JSON."},
                             {"role": "assistant", "content": '{"answer":'}]).conversation()
    rendered = render_prompt(prompts, conv)
    assert rendered == prompts.render(conv.messages[:1]) + '{"answer":'  # generation prompt, then the prefill
    trailing, _ = body(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": "So "}]).conversation()
    with pytest.raises(ApiError, match="trailing whitespace"):
        render_prompt(prompts, trailing)
