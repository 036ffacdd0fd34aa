"""Trace parsing: block keys and partial last blocks."""

from __future__ import annotations

import json
from pathlib import Path

from kvmesh.sim.trace import TRACE_BLOCK_TOKENS, Trace, block_key, load_trace, parse_line, returning


def test_load_trace_keys_times_and_partial_last_block(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 1500, "input_length": 1100, "output_length": 3, "hash_ids": [0, 1, 2]},
        {"timestamp": 2000, "input_length": 1024, "output_length": 1, "hash_ids": [0, 1]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    trace = load_trace(path)
    first, second = trace.requests
    assert first.time_s == 1.5 and first.blocks == (block_key(0), block_key(1), block_key(2))
    assert [first.block_tokens(i) for i in range(3)] == [TRACE_BLOCK_TOKENS, TRACE_BLOCK_TOKENS, 76]
    assert second.block_tokens(1) == TRACE_BLOCK_TOKENS  # an exact multiple: no partial block
    assert (trace.input_blocks, trace.unique_blocks) == (5, 3)
    assert len(load_trace(path, limit=1).requests) == 1
    assert block_key(1) != block_key(256) and len(block_key(2**40)) == 8


def test_agent_fields_are_optional_and_parsed() -> None:
    plain = parse_line('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}')
    assert plain.session_id is None and plain.tool_calls is None
    agent = parse_line('{"timestamp": 5, "input_length": 10, "output_length": 1, "hash_ids": [1], '
                       '"session_id": "s1", "tool_calls": ["bash", "edit"]}')
    assert agent.session_id == "s1" and agent.tool_calls == ("bash", "edit")
    answer = parse_line('{"timestamp": 5, "input_length": 10, "hash_ids": [1], "session_id": 7, "tool_calls": []}')
    assert answer.session_id == "7" and answer.tool_calls == ()


def test_returning_turns_are_later_turns_of_named_sessions() -> None:
    rows = [{"timestamp": t, "input_length": 600, "output_length": 5, "hash_ids": [1, 2], **extra}
            for t, extra in ((0, {"session_id": "a"}), (1, {"session_id": "b"}), (2, {"session_id": "a"}),
                             (3, {}), (4, {"session_id": "b"}))]
    trace = Trace("t", tuple(parse_line(json.dumps(r)) for r in rows))
    assert returning(trace) == [False, False, True, False, True]
