"""Fixtures for worker-level serving tests: a tiny model, the env a worker process gets, and a reference engine."""

from __future__ import annotations

import pytest
from kvmesh.config import EngineSettings

from .harness import BLOCK_SIZE


@pytest.fixture(scope="session")
def reference(tiny_loaded):
    """`generate(prompt_ids, max_tokens) -> output ids`: a fresh in-process engine per call, greedy (the reference)."""
    from kvmesh.engine.engine import Engine
    from kvmesh.engine.sampling import SamplingParams

    loaded = tiny_loaded

    def generate(prompt_ids: list[int], max_tokens: int, **kw) -> list[int]:
        engine = Engine(loaded, EngineSettings(block_size=BLOCK_SIZE, num_blocks=512))
        return engine.generate([prompt_ids], SamplingParams(max_tokens=max_tokens, **kw))[0].token_ids

    generate.tokenizer = loaded.tokenizer
    generate.fingerprint = loaded.fingerprint
    return generate
