"""Trace parsing: block keys and partial last blocks."""

from __future__ import annotations

import json
from pathlib import Path

from shared.sim.trace import TRACE_BLOCK_TOKENS, block_key, load_trace


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
