"""The tool-call scanner: any split of a text streams the same calls and text as the whole text parses."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from kvmesh.toolcalls.formats import HERMES, LLAMA3_JSON, ToolFormat
from kvmesh.toolcalls.parse import parse_output
from kvmesh.toolcalls.stream import (
    ArgsDelta,
    CallStart,
    Delta,
    TextDelta,
    ToolCallStream,
)

NAMES = ("get_weather", "f")

json_leaf = st.one_of(st.integers(-5, 99), st.booleans(), st.none(), st.text("ab}{\"\\ ;<>", max_size=4))
json_value = st.recursive(json_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text("xyz\"}", min_size=1, max_size=3), inner, max_size=3)),
    max_leaves=6)
arguments = st.dictionaries(st.text("abc\"{", min_size=1, max_size=4), json_value, max_size=3)


def call_text(fmt: ToolFormat, name: str, args: dict[str, Any], indent: int | None) -> str:
    return fmt.call_open + json.dumps({"name": name, fmt.args_key: args}, indent=indent) + fmt.call_close


def calls_strategy(fmt: ToolFormat) -> st.SearchStrategy[str]:
    return st.builds(call_text, st.just(fmt), st.sampled_from((*NAMES, "unknown")), arguments,
                     st.sampled_from((None, 2)))


def noise(fmt: ToolFormat) -> st.SearchStrategy[str]:
    """Fragments of call syntax and text, so partial, broken and unknown calls show up."""
    frags = ["<tool_call>\n", "\n</tool_call>", "<tool_", "\n", " ", "{", "}", '"name"', ": ", '"f"', ", ",
             '"arguments"', '"parameters"', '{"x": 1}', ";", "; ", "<|python_tag|>", "a", '"', "\\", "[", "]"]
    return st.one_of(st.sampled_from(frags), st.text(max_size=5), calls_strategy(fmt))


def texts(fmt: ToolFormat) -> st.SearchStrategy[str]:
    return st.lists(noise(fmt), max_size=12).map("".join)


def run(fmt: ToolFormat, pieces: list[str]) -> tuple[str, list[tuple[str, str]], ToolCallStream]:
    """Feed `pieces`; (text, [(name, arguments)], the stream), checking the delta protocol on the way."""
    stream = ToolCallStream(fmt, NAMES)
    deltas: list[Delta] = []
    for piece in pieces:
        deltas += stream.feed(piece)
    deltas += stream.finish()
    text, calls = [], []
    for d in deltas:
        if isinstance(d, TextDelta):
            assert d.text
            text.append(d.text)
        elif isinstance(d, CallStart):
            assert d.index == len(calls) and d.id.startswith("call_") and len(d.id) == 29
            calls.append((d.name, ""))
        else:
            assert isinstance(d, ArgsDelta) and d.index == len(calls) - 1 and d.fragment
            calls[-1] = (calls[-1][0], calls[-1][1] + d.fragment)
    return "".join(text), calls, stream


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in zip(points, points[1:])]


@settings(max_examples=400, deadline=None)
@given(data=st.data(), fmt=st.sampled_from((HERMES, LLAMA3_JSON)))
def test_any_split_streams_what_the_whole_text_parses(data: st.DataObject, fmt: ToolFormat) -> None:
    text = data.draw(texts(fmt))
    cuts = data.draw(st.lists(st.integers(0, 10_000), max_size=8))
    whole_text, whole_calls, whole = run(fmt, [text])
    split_text, split_calls, _ = run(fmt, split(text, cuts))
    assert (split_text, split_calls) == (whole_text, whole_calls)
    # every character is text or inside exactly one call's span
    spans = [(c.start, c.end) for c in whole.calls]
    assert all(a < b for a, b in spans) and all(b <= c for (_, b), (c, _) in zip(spans, spans[1:]))
    outside, at = [], 0
    for a, b in spans:
        outside.append(text[at:a])
        at = b
    assert "".join(outside) + text[at:] == whole_text
    parsed = parse_output(text, fmt, NAMES)
    if all(c.complete and not c.malformed and isinstance(_loads(c.arguments), dict) for c in whole.calls):
        assert (parsed.content, [(c.name, c.arguments) for c in parsed.calls]) == (whole_text, whole_calls)
    assert len(parsed.calls) <= len(whole_calls)


def _loads(s: str) -> Any:
    try:
        return json.loads(s)
    except json.JSONDecodeError:
        return None


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_hermes_calls_between_texts_are_found_exactly(data: st.DataObject) -> None:
    plain = st.text(st.characters(blacklist_characters="<"), max_size=8)
    parts = data.draw(st.lists(st.tuples(plain, st.sampled_from(NAMES), arguments), min_size=1, max_size=3))
    tail = data.draw(plain)
    text = "".join(t + call_text(HERMES, n, a, None) for t, n, a in parts) + tail
    out = parse_output(text, HERMES, NAMES)
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [(n, a) for _, n, a in parts]
    # whitespace-only text before a call is part of that call's span; any other text is content as written
    assert out.content == "".join(t for t, _, _ in parts if t.strip()) + tail
    assert run(HERMES, split(text, data.draw(st.lists(st.integers(0, 999)))))[0] == out.content


@settings(max_examples=200, deadline=None)
@given(calls=st.lists(st.tuples(st.sampled_from(NAMES), arguments), min_size=1, max_size=3),
       tag=st.booleans(), sep=st.sampled_from(("; ", ";", " ; ", ";\n")))
def test_llama3_parallel_calls_are_found_exactly(calls: list[tuple[str, dict]], tag: bool, sep: str) -> None:
    text = ("<|python_tag|>" if tag else "") + sep.join(call_text(LLAMA3_JSON, n, a, None) for n, a in calls)
    out = parse_output(text, LLAMA3_JSON, NAMES)
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == calls and out.content == ""
