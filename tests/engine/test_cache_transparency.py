"""THE invariant: greedy tokens are identical whether prefixes were cached, chunked, preempted or imported.

Reference: every prompt alone in a cache-off engine with one big prefill.
Under test, over random prompt sets sharing prefixes: (a) prompts in order
through one caching engine (hits on earlier prompts); (b) all at once in a
tiny pool with a tiny token budget (chunked prefill, preemption, recompute
from cache); (c) blocks exported from (a) imported into a fresh engine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvmesh.config import EngineSettings
from kvmesh.engine.engine import Engine
from kvmesh.engine.loader import LoadedModel, load_model
from kvmesh.engine.sampling import SamplingParams

BS = 4
MAX_TOKENS = 6
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=["tiny_model_dir", "tiny_qwen2_model_dir"])
def loaded(request: pytest.FixtureRequest) -> LoadedModel:
    model_dir: Path = request.getfixturevalue(request.param)
    return load_model(model_dir)


def make(loaded: LoadedModel, **kw) -> Engine:
    return Engine(loaded, EngineSettings(**{"block_size": BS, "num_blocks": 256, **kw}))


@st.composite
def prompt_sets(draw) -> list[list[int]]:
    token = st.integers(5, 1000)
    roots = draw(st.lists(st.lists(token, min_size=1, max_size=24), min_size=1, max_size=2))
    prompts = []
    for _ in range(draw(st.integers(2, 4))):
        root = draw(st.sampled_from(roots))
        cut = draw(st.integers(0, len(root)))
        prompts.append(root[:cut] + draw(st.lists(token, min_size=1, max_size=12)))
    return prompts


def reference(loaded: LoadedModel, prompts: list[list[int]]) -> list[list[int]]:
    return [
        make(loaded, enable_prefix_caching=False).generate([p], PARAMS)[0].token_ids for p in prompts
    ]


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompts=prompt_sets())
def test_greedy_tokens_identical_with_and_without_cache(loaded: LoadedModel, prompts: list[list[int]]) -> None:
    want = reference(loaded, prompts)

    seq = make(loaded)
    got = [seq.generate([p], PARAMS)[0] for p in prompts]
    assert [o.token_ids for o in got] == want

    # Tiny pool + tiny budget: chunked prefill, preemption, recompute mostly from cache.
    tiny = make(loaded, num_blocks=12, max_num_batched_tokens=5, max_num_seqs=4)
    assert [o.token_ids for o in tiny.generate(prompts, PARAMS)] == want

    fresh = make(loaded)
    for p in prompts:
        fresh.import_blocks(seq.export_blocks(seq.block_hashes(p)))
    outs = [fresh.generate([p], PARAMS)[0] for p in prompts]
    assert [o.token_ids for o in outs] == want
    assert all(o.cached_tokens == (len(p) - 1) // BS * BS for o, p in zip(outs, prompts))


@pytest.mark.parametrize("policy", ["lru", "cost", "tinylfu", "session", "default"])
def test_preemption_and_chunking_really_happen(loaded: LoadedModel, policy: str) -> None:
    """Pins the pressure the property test relies on, under LRU, the generic-heap policies and session retention."""
    root = list(range(100, 130))
    prompts = [root + [7, 8, 9], root[:20] + [11] * 10, list(range(300, 330)), root[:9] + [5] * 21]
    want = reference(loaded, prompts)
    tiny = make(loaded, num_blocks=14, max_num_batched_tokens=7, max_num_seqs=4, eviction_policy=policy)
    outs = tiny.generate(prompts, PARAMS)
    assert [o.token_ids for o in outs] == want
    assert tiny.scheduler.num_preemptions > 0
    assert tiny.cache.policy.name == policy
    if policy == "lru":
        assert tiny.cache.stats.hit_tokens > 0
