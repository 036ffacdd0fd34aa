"""parse_output and the scanner on the cases the streaming rules single out."""

from __future__ import annotations

from kvmesh.toolcalls.formats import HERMES, LLAMA3_JSON
from kvmesh.toolcalls.parse import parse_output
from kvmesh.toolcalls.stream import ArgsDelta, CallStart, TextDelta, ToolCallStream

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_hermes_text_then_parallel_calls() -> None:
    text = "Checking.\n" + WEATHER + "\n" + WEATHER.replace("Paris", "Oslo") + "\n"
    out = parse_output(text, HERMES, ["get_weather"])
    assert [c.arguments for c in out.calls] == ['{"city": "Paris"}', '{"city": "Oslo"}']
    assert out.content == "Checking.\n\n"
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in out.calls)
    assert out.calls[0].id != out.calls[1].id


def test_unknown_tool_and_name_not_first_stay_text() -> None:
    assert parse_output(WEATHER, HERMES, ["search"]).calls == []
    assert parse_output(WEATHER, HERMES, ["search"]).content == WEATHER
    swapped = '<tool_call>\n{"arguments": {}, "name": "get_weather"}\n</tool_call>'
    assert parse_output(swapped, HERMES).content == swapped


def test_any_name_when_no_tools_are_named() -> None:
    assert [c.name for c in parse_output(WEATHER, HERMES).calls] == ["get_weather"]


def test_call_without_arguments_has_an_empty_object() -> None:
    out = parse_output('{"name": "now"}', LLAMA3_JSON, ["now"])
    assert [(c.name, c.arguments) for c in out.calls] == [("now", "{}")]


def test_llama3_calls_only_lead_the_output() -> None:
    call = '{"name": "f", "parameters": {"x": 1}}'
    assert parse_output("Sure: " + call, LLAMA3_JSON, ["f"]).calls == []
    out = parse_output("<|python_tag|>" + call + "; " + call + " and more", LLAMA3_JSON, ["f"])
    assert len(out.calls) == 2 and out.content == " and more"
    # either arguments key is taken, whatever the format's own
    assert parse_output('{"name": "f", "arguments": {"x": 1}}', LLAMA3_JSON).calls[0].arguments == '{"x": 1}'


def test_cut_short_call_streams_as_a_call_but_parses_as_text() -> None:
    text = WEATHER[:-30]
    stream = ToolCallStream(HERMES, ["get_weather"])
    deltas = stream.feed(text) + stream.finish()
    assert isinstance(deltas[0], CallStart) and deltas[0].name == "get_weather"
    assert all(isinstance(d, ArgsDelta) for d in deltas[1:]) and not stream.calls[0].complete
    out = parse_output(text, HERMES, ["get_weather"])
    assert out.calls == [] and out.content == text


def test_held_start_is_released_as_text_at_finish() -> None:
    stream = ToolCallStream(HERMES, ["get_weather"])
    assert stream.feed("Hi <tool_") == [TextDelta("Hi ")]
    assert stream.feed('call>\n{"name": "get_') == []
    assert stream.finish() == [TextDelta('<tool_call>\n{"name": "get_')]


def test_text_is_released_once_it_cannot_start_a_call() -> None:
    stream = ToolCallStream(LLAMA3_JSON, ["f"])
    assert stream.feed("  <|python") == []
    assert stream.feed("_tag|>{ \"na") == []
    assert stream.feed("x") == [TextDelta('  <|python_tag|>{ "nax')]
    assert stream.feed(' {"name": "f"}') == [TextDelta(' {"name": "f"}')]  # after text: no call in this format


def test_arguments_stream_in_fragments_as_they_arrive() -> None:
    stream = ToolCallStream(HERMES, ["get_weather"])
    first = stream.feed('<tool_call>\n{"name": "get_weather", "arguments": {"ci')
    assert [type(d) for d in first] == [CallStart, ArgsDelta] and first[1] == ArgsDelta(0, '{"ci')
    assert stream.feed('ty": "Paris"}}\n</tool') == [ArgsDelta(0, 'ty": "Paris"}')]
    assert stream.feed("_call>\nbye") + stream.finish() == [TextDelta("\nbye")]


def test_malformed_object_after_the_name_is_skipped_to_its_end() -> None:
    text = '<tool_call>\n{"name": "f" oops {"a": "}"}}\n</tool_call>after'
    stream = ToolCallStream(HERMES, ["f"])
    deltas = stream.feed(text) + stream.finish()
    assert deltas[-1] == TextDelta("after") and stream.calls[0].complete
    assert stream.calls[0].malformed
    assert parse_output(text, HERMES, ["f"]).content == text
