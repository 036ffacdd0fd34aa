"""Bounded schemas end: a random walk through any schema's grammar stops, and what it wrote validates."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvmesh.config import ConstraintSettings
from kvmesh.constrain.bounds import KEY_PATTERN, bound_schema
from kvmesh.constrain.masks import MaskFiller
from kvmesh.constrain.matcher import GrammarCompiler
from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.protocol.serving import Constraint

BOUNDS = ConstraintSettings()
EOS = (1, 4)

_leaf = st.one_of(
    st.just({"type": "string"}),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 12)),
    st.builds(lambda lo: {"type": "integer", "minimum": lo}, st.integers(-50, 50)),
    st.just({"type": "integer"}),
    st.just({"type": "number"}),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(st.sampled_from(["a", "b", 3, None, True]), min_size=1, max_size=3, unique=True).map(lambda v: {"enum": v}),
    st.just({}),
)


def _object(props: dict, extra: object, required_all: bool) -> dict:
    schema = {"type": "object", "properties": props}
    if required_all:
        schema["required"] = sorted(props)
    if extra != "absent":
        schema["additionalProperties"] = extra
    return schema


schemas = st.recursive(
    _leaf,
    lambda inner: st.one_of(
        st.builds(lambda items: {"type": "array", "items": items}, inner),
        st.builds(_object, st.dictionaries(st.from_regex(r"[a-z]{1,6}", fullmatch=True), inner, max_size=3),
                  st.sampled_from(["absent", True, False, {"type": "integer"}]), st.booleans()),
    ),
    max_leaves=5,
)


@pytest.fixture(scope="module")
def compiler(tiny_model_dir: Path) -> GrammarCompiler:
    return GrammarCompiler(Tokenizer.from_dir(tiny_model_dir).to_json(), 1024, EOS, BOUNDS)


def walk(compiler: GrammarCompiler, constraint: Constraint, seed: int, limit: int = 4000) -> list[int]:
    """Random logits, masked: the worst a model can do. Stops at EOS or when the grammar is complete."""
    matcher = compiler.matcher(constraint.model_dump_json())
    filler = MaskFiller(compiler.vocab_size, EOS, overlap=False)
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for _ in range(limit):
        logits = torch.randn((1, compiler.vocab_size), generator=gen)
        filler.apply(filler.start([matcher]), logits)
        tok = int(torch.argmax(logits))
        if tok in EOS:
            break
        out.append(tok)
        if matcher.advance(tok):
            break
    else:
        raise AssertionError(f"no end after {limit} tokens")
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=schemas, seed=st.integers(0, 2**16))
def test_random_walk_ends_and_validates(compiler: GrammarCompiler, tiny_model_dir: Path, schema: dict, seed: int) -> None:
    tokens = walk(compiler, Constraint(kind="json", json_schema=schema), seed)
    text = Tokenizer.from_dir(tiny_model_dir).decode(tokens)
    jsonschema.validate(json.loads(text), schema)
    assert text == dumps_keeping_numbers(text)  # json.dumps spacing, nothing else


def dumps_keeping_numbers(text: str) -> str:
    """`text` re-encoded by json.dumps, each number literal kept as written.

    The grammar fixes spacing, not number spelling: `7.50` is valid JSON that json.dumps writes as `7.5`
    (docs/constrained-decoding.md). Each literal travels through dumps as a marked string and is put back.
    """
    def mark(literal: str) -> str:
        return f"\x00{literal}\x00"
    obj = json.loads(text, parse_float=mark, parse_int=mark)
    return json.dumps(obj, ensure_ascii=False).replace('"\\u0000', "").replace('\\u0000"', "")


def test_bounds_apply_only_where_the_schema_is_silent() -> None:
    schema = {"type": "object", "properties": {
        "s": {"type": "string"}, "fixed": {"type": "string", "maxLength": 500}, "long": {"type": "string", "minLength": 90},
        "n": {"type": "number", "minimum": 2}, "i": {"type": "integer", "maximum": -5}, "a": {"type": "array", "minItems": 20},
        "free": {"type": "object"}, "named": {"type": "object", "properties": {}, "additionalProperties": {"type": "null"}},
    }}
    before = json.dumps(schema)
    p = bound_schema(schema, BOUNDS)["properties"]
    assert json.dumps(schema) == before  # the input is left alone
    assert p["s"]["maxLength"] == BOUNDS.max_string_length and p["fixed"]["maxLength"] == 500
    assert p["long"]["maxLength"] == 90
    assert p["n"] == {"type": "number", "minimum": 2, "maximum": 10**9 - 1, "multipleOf": 10.0**-4}
    assert p["i"] == {"type": "integer", "minimum": -(10**9 - 1), "maximum": -5}
    assert p["a"]["maxItems"] == 20
    assert p["free"]["additionalProperties"] is False and KEY_PATTERN in p["free"]["patternProperties"]
    assert p["named"]["patternProperties"] == {KEY_PATTERN: {"type": "null"}} and p["named"]["maxProperties"] == 8
    assert bound_schema(schema, BOUNDS)["additionalProperties"] is False
