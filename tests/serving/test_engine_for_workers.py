"""The engine features the workers rely on: resume from generated tokens, cold recompute, TTL pins."""

from __future__ import annotations

import time

import pytest
from kvmesh.config import EngineSettings
from kvmesh.engine.engine import Engine
from kvmesh.engine.sampling import SamplingParams

from .harness import BLOCK_SIZE


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    from kvmesh.engine.loader import load_model

    return load_model(tiny_model_dir)


def _engine(loaded, num_blocks: int = 256) -> Engine:
    return Engine(loaded, EngineSettings(block_size=BLOCK_SIZE, num_blocks=num_blocks))


def _run(engine: Engine, rid: str, prompt: list[int], params: SamplingParams, **kw):
    engine.add_request(rid, prompt, params, **kw)
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out


def test_resume_from_generated_gives_the_same_tokens_and_text(loaded):
    prompt = loaded.tokenizer.encode("Resume me halfway through, please, and keep the text whole.")
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    full = _run(_engine(loaded), "full", prompt, params)
    resumed_engine = _engine(loaded)
    pieces: list[str] = []
    resumed_engine.add_request("half", prompt, params, generated=full.token_ids[:7])
    done = None
    while done is None:
        for out in resumed_engine.step():
            pieces.append(out.text_delta)
            done = out if out.finished else None
    assert done.token_ids == full.token_ids
    assert done.finish_reason == "length"
    assert full.text.endswith("".join(pieces)) and len("".join(pieces)) < len(full.text)


def test_resumed_seeded_sampling_draws_what_the_whole_run_draws(loaded):
    prompt = loaded.tokenizer.encode("Sampled, seeded, and moved to another worker after a few tokens.")
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    full = _run(_engine(loaded), "full", prompt, params)
    resumed = _run(_engine(loaded), "half", prompt, params, generated=full.token_ids[:5])
    assert resumed.token_ids == full.token_ids
    other_seed = _run(_engine(loaded), "other", prompt, SamplingParams(max_tokens=16, temperature=0.9, seed=99,
                                                                         ignore_eos=True))
    assert other_seed.token_ids != full.token_ids  # the check can fail: the seed matters


def test_generated_counts_against_max_tokens(loaded):
    with pytest.raises(ValueError, match="already generated"):
        _engine(loaded).add_request("x", [1, 2, 3], SamplingParams(max_tokens=2), generated=[4, 5, 6])


def test_a_migration_whose_tokens_already_end_it_finishes_without_a_new_token(loaded):
    """The first worker produced every token but its final event was lost: the new attempt ends at once,
    with the reason and the text the whole run had (a stop token, a stop string, max_tokens)."""
    prompt = loaded.tokenizer.encode("Every token was delivered; only the final event went missing.")
    free = _run(_engine(loaded), "free", prompt, SamplingParams(max_tokens=24, ignore_eos=True))
    stop_text = free.text[len(free.text) // 2:][:3]
    cases = {
        "length": SamplingParams(max_tokens=24, ignore_eos=True),
        "stop token": SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=[free.token_ids[9]]),
        "stop string": SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop_text]),
    }
    for case, params in cases.items():
        whole = _run(_engine(loaded), "whole", prompt, params)
        assert whole.finish_reason == ("length" if case == "length" else "stop"), case
        engine = _engine(loaded)
        engine.add_request("again", prompt, params, generated=whole.token_ids)
        (out,) = engine.step()
        assert out.finished and out.finish_reason == whole.finish_reason, case
        assert out.new_token_ids == [] and out.token_ids == whole.token_ids, case
        assert out.text == whole.text, case
        assert not engine.has_unfinished() and engine.cache.pool.num_free == engine.settings.num_blocks, case


def test_use_cache_false_recomputes_cold(loaded):
    engine = _engine(loaded)
    prompt = loaded.tokenizer.encode("A prompt long enough to fill a few blocks of sixteen tokens each. " * 2)
    params = SamplingParams(max_tokens=6)
    first = _run(engine, "a", prompt, params)
    hit = _run(engine, "b", prompt, params)
    cold = _run(engine, "c", prompt, params, use_cache=False)
    assert hit.cached_tokens > 0 and cold.cached_tokens == 0
    assert first.token_ids == hit.token_ids == cold.token_ids


def test_pins_keep_blocks_until_their_time(loaded):
    # LRU: what is checked is the pin's time, not a ranking (the default policy's cost order would keep the
    # four-block chain over the churn's one-off blocks after the pin lapses, too)
    engine = Engine(loaded, EngineSettings(block_size=BLOCK_SIZE, num_blocks=12, eviction_policy="lru"))
    params = SamplingParams(max_tokens=1)
    keep = list(range(10, 10 + 4 * BLOCK_SIZE + 1))
    _run(engine, "keep", keep, params)
    hashes = engine.block_hashes(keep)
    assert engine.pin(hashes, time.time() + 1.0) == 4
    assert engine.pin(hashes, time.time() - 1) == 4  # an earlier time never shortens a pin
    for i in range(3):  # each needs 8 of the 12 blocks: everything unpinned is evicted on the way
        _run(engine, f"churn{i}", [100 + i] * (8 * BLOCK_SIZE - 1), params)
    assert engine.cached_prefix_tokens(keep) == 4 * BLOCK_SIZE
    time.sleep(1.1)  # the pin lapses; the next steps release it and churn evicts the blocks
    for i in range(2):
        _run(engine, f"after{i}", [200 + i] * (8 * BLOCK_SIZE - 1), params)
    assert engine.cached_prefix_tokens(keep) < 4 * BLOCK_SIZE
    assert len(engine.pins) == 0


def test_pins_never_pass_their_budget(loaded):
    engine = Engine(loaded, EngineSettings(block_size=BLOCK_SIZE, num_blocks=16, pin_fraction=0.25))  # 4 blocks
    params = SamplingParams(max_tokens=1)
    first, second = list(range(10, 10 + 3 * BLOCK_SIZE + 1)), list(range(300, 300 + 3 * BLOCK_SIZE + 1))
    _run(engine, "first", first, params)
    _run(engine, "second", second, params)
    until = time.time() + 60
    assert engine.pin(engine.block_hashes(first), until) == 3
    assert engine.pin(engine.block_hashes(second), until) == 1  # only the leading block fits
    assert engine.pin(engine.block_hashes(first), until + 1) == 3  # extending a pinned block costs nothing
    assert len(engine.pins) == 4 == engine.pins.limit
