"""Constrained decoding in the engine, from the random tiny model: output parses, validates, and stops.

Also: unconstrained neighbours in the batch are untouched, the prefix cache
still hits, a migrated request (generated replayed) continues the same run.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from kvmesh.config import EngineSettings
from kvmesh.engine.engine import Engine
from kvmesh.engine.loader import LoadedModel, load_model
from kvmesh.engine.sampling import SamplingParams
from kvmesh.protocol.serving import Constraint, ToolSchema
from kvmesh.toolcalls.formats import get_format

SCHEMAS = {
    "any_object": None,
    "order": {"type": "object", "properties": {
        "id": {"type": "integer"}, "status": {"enum": ["open", "paid", "shipped"]},
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}}, "required": ["sku", "qty"]}},
        "note": {"type": ["string", "null"]}}, "required": ["id", "status", "items"]},
    "array_of_numbers": {"type": "array", "items": {"type": "number"}, "minItems": 1},
}
TOOLS = [
    ToolSchema(name="get_weather", parameters={"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}, "required": ["city"]}),
    ToolSchema(name="search", parameters={"type": "object", "properties": {"q": {"type": "string"},
                                                                          "k": {"type": "integer"}}}),
    ToolSchema(name="ping"),
]
SAMPLINGS = {"greedy": {}, "seeded": {"temperature": 1.0, "top_p": 0.95, "seed": 7}}


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path) -> LoadedModel:
    return load_model(tiny_model_dir)


def engine(loaded: LoadedModel) -> Engine:
    return Engine(loaded, EngineSettings(block_size=8, num_blocks=512))


def params(constraint: Constraint | None, max_tokens: int = 1500, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, constraint=None if constraint is None else constraint.model_dump_json(),
                          **kw)


def parse_calls(text: str, format_name: str) -> list[dict]:
    """The calls in `text`, read strictly by the format (nothing before, between or after them)."""
    fmt, decoder, calls, pos = get_format(format_name), json.JSONDecoder(), [], 0
    while True:
        assert text.startswith(fmt.call_open, pos), text
        call, pos = decoder.raw_decode(text, pos + len(fmt.call_open))
        assert text.startswith(fmt.call_close, pos), text
        calls.append(call)
        pos += len(fmt.call_close)
        if pos == len(text):
            return calls
        assert text.startswith(fmt.separator, pos), text
        pos += len(fmt.separator)


@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("schema", SCHEMAS)
def test_json_output_parses_validates_and_stops(loaded: LoadedModel, schema: str, sampling: str) -> None:
    c = Constraint(kind="json", json_schema=SCHEMAS[schema])
    prompt = loaded.tokenizer.encode("Reply with the order as JSON.")
    out = engine(loaded).generate([prompt], params(c, **SAMPLINGS[sampling]))[0]
    assert out.finish_reason == "stop"
    value = json.loads(out.text)
    jsonschema.validate(value, SCHEMAS[schema] or {"type": "object"})
    assert out.text == json.dumps(value, ensure_ascii=False)


@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize(("tool_format", "parallel", "tools"), [
    ("hermes", True, TOOLS), ("llama3_json", True, TOOLS), ("hermes", False, TOOLS[:1]), ("llama3_json", False, TOOLS[1:])])
def test_tool_calls_parse_and_validate(loaded: LoadedModel, tool_format: str, parallel: bool, tools: list, sampling: str) -> None:
    c = Constraint(kind="tool_calls", tools=tools, tool_format=tool_format, parallel=parallel)
    prompt = loaded.tokenizer.encode("What is the weather in Paris?")
    out = engine(loaded).generate([prompt], params(c, **SAMPLINGS[sampling]))[0]
    assert out.finish_reason == "stop"
    calls = parse_calls(out.text, tool_format)
    assert 1 <= len(calls) <= (EngineSettings().constraints.max_parallel_calls if parallel else 1)
    by_name = {t.name: t.parameters for t in tools}
    args_key = get_format(tool_format).args_key
    for call in calls:
        assert list(call) == ["name", args_key]
        jsonschema.validate(call[args_key], by_name[call["name"]])


def test_unconstrained_rows_are_untouched_by_constrained_neighbours(loaded: LoadedModel) -> None:
    prompts = [loaded.tokenizer.encode(t) for t in ("The cache block", "An agent calls a tool", "Summary of the plan")]
    plain = [params(None, 24, ignore_eos=True), params(None, 24, temperature=0.8, seed=3, ignore_eos=True)]
    alone = engine(loaded).generate(prompts[:2], plain)
    c = Constraint(kind="tool_calls", tools=TOOLS, tool_format="hermes")
    mixed = engine(loaded).generate(prompts + prompts[:1], [*plain, params(c), params(Constraint(kind="json"))])
    assert [o.token_ids for o in mixed[:2]] == [o.token_ids for o in alone]
    assert mixed[2].finish_reason == mixed[3].finish_reason == "stop"


def test_constrained_request_hits_the_prefix_cache(loaded: LoadedModel) -> None:
    eng = engine(loaded)
    prompt = loaded.tokenizer.encode("You are a helpful agent with tools. " * 4)
    c = Constraint(kind="json", json_schema=SCHEMAS["order"])
    first = eng.generate([prompt], params(c))[0]
    second = eng.generate([prompt], params(c))[0]
    assert first.cached_tokens == 0
    assert second.cached_tokens == len(prompt) // 8 * 8 > 0
    assert second.token_ids == first.token_ids


@pytest.mark.parametrize("cut", [1, 9, None])  # None: every token (the grammar is complete already)
def test_migration_replays_generated_and_continues_the_same_run(loaded: LoadedModel, cut: int | None) -> None:
    c = Constraint(kind="tool_calls", tools=TOOLS, tool_format="llama3_json")
    p = params(c, temperature=1.0, seed=11)
    prompt = loaded.tokenizer.encode("Call the right tool.")
    whole = engine(loaded).generate([prompt], p)[0]
    cut = len(whole.token_ids) if cut is None else cut
    assert len(whole.token_ids) >= cut
    resumed = engine(loaded)
    resumed.add_request("m", prompt, p, generated=whole.token_ids[:cut])
    rest: list[int] = []
    while resumed.has_unfinished():
        for out in resumed.step():
            rest.extend(out.new_token_ids)
            final = out
    assert whole.token_ids[:cut] + rest == whole.token_ids
    assert final.text == whole.text and final.finish_reason == "stop"


def test_max_tokens_and_bad_constraints_still_apply(loaded: LoadedModel) -> None:
    eng = engine(loaded)
    prompt = loaded.tokenizer.encode("JSON")
    out = eng.generate([prompt], params(Constraint(kind="json"), max_tokens=3))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    with pytest.raises(ValueError, match="Invalid type"):
        eng.add_request("bad", prompt, params(Constraint(kind="json", json_schema={"type": "nope"})))
    with pytest.raises(ValueError, match="outside the constraint"):
        eng.add_request("off", prompt, params(Constraint(kind="json")), generated=loaded.tokenizer.encode("no"))
    assert not eng.has_unfinished()
