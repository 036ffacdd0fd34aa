"""Engine API on the tiny checkpoint: validation, finishing, streaming, abort, reuse, export/import."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from kvmesh.config import EngineSettings
from kvmesh.engine.engine import Engine
from kvmesh.engine.loader import LoadedModel, load_model
from kvmesh.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path) -> LoadedModel:
    return load_model(tiny_model_dir)


def engine(loaded: LoadedModel, **kw) -> Engine:
    return Engine(loaded, EngineSettings(**{"block_size": 8, "num_blocks": 128, **kw}))


def prompt(loaded: LoadedModel, text: str) -> list[int]:
    return loaded.tokenizer.encode(text)


def test_rejects_empty_and_too_long_prompts(loaded: LoadedModel) -> None:
    eng = engine(loaded)
    with pytest.raises(ValueError, match="empty"):
        eng.add_request("a", [], GREEDY)
    limit = loaded.config.max_position_embeddings
    with pytest.raises(ValueError, match="exceeds the context"):
        eng.add_request("b", [5] * (limit - 3), SamplingParams(max_tokens=4))
    eng.add_request("c", [5, 6], GREEDY)
    with pytest.raises(ValueError, match="already exists"):
        eng.add_request("c", [5, 6], GREEDY)


def test_length_finish_streaming_and_timing(loaded: LoadedModel) -> None:
    eng = engine(loaded)
    eng.add_request("r", prompt(loaded, "Once upon a time there was"), GREEDY)
    outs = []
    while eng.has_unfinished():
        outs.extend(eng.step())
    final = outs[-1]
    assert final.finished and final.finish_reason == "length" and len(final.token_ids) == 12
    assert [t for o in outs for t in o.new_token_ids] == final.token_ids
    assert "".join(o.text_delta for o in outs) == final.text
    assert final.text == loaded.tokenizer.decode(final.token_ids)
    assert final.ttft is not None and final.ttft > 0 and final.finished_time >= final.first_token_time


def test_stop_token_and_stop_string(loaded: LoadedModel) -> None:
    eng = engine(loaded)
    p = prompt(loaded, "The weather today is")
    ref = eng.generate([p], GREEDY)[0]
    stop_tok = ref.token_ids[4]
    out = eng.generate([p], SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=(stop_tok,)))[0]
    first = ref.token_ids.index(stop_tok)
    assert out.finish_reason == "stop" and out.token_ids == ref.token_ids[: first + 1]
    stop_str = ref.text[len(ref.text) // 2 : len(ref.text) // 2 + 3]
    out = eng.generate([p], SamplingParams(max_tokens=12, ignore_eos=True, stop=(stop_str,)))[0]
    assert out.finish_reason == "stop" and out.text == ref.text[: ref.text.find(stop_str)]


def test_eos_finishes_unless_ignored(loaded: LoadedModel, tiny_model_dir: Path, tmp_path: Path) -> None:
    p = prompt(loaded, "Hello there")
    ref = engine(loaded).generate([p], GREEDY)[0]
    # The same weights with a generation_config whose eos is a token greedy decoding produces.
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    gen = json.loads((model_dir / "generation_config.json").read_text())
    gen["eos_token_id"] = [ref.token_ids[3]]
    (model_dir / "generation_config.json").write_text(json.dumps(gen))
    eos_loaded = load_model(model_dir)
    out = engine(eos_loaded).generate([p], SamplingParams(max_tokens=12))[0]
    first = ref.token_ids.index(ref.token_ids[3])
    assert out.finish_reason == "stop" and out.token_ids == ref.token_ids[: first + 1]
    assert engine(eos_loaded).generate([p], GREEDY)[0].token_ids == ref.token_ids


def test_abort_reports_and_frees(loaded: LoadedModel) -> None:
    eng = engine(loaded)
    free_before = eng.cache.num_allocatable
    eng.add_request("x", prompt(loaded, "a long story about"), SamplingParams(max_tokens=50))
    eng.step()
    eng.abort("x")
    outs = eng.step()
    assert [(o.request_id, o.finished, o.finish_reason) for o in outs] == [("x", True, "abort")]
    assert not eng.has_unfinished() and eng.cache.num_allocatable == free_before


def test_next_turn_hits_previous_answer(loaded: LoadedModel) -> None:
    eng = engine(loaded)
    turn1 = prompt(loaded, "System: you are helpful. User: tell me about the sea and the sky.")
    out1 = eng.generate([turn1], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    assert out1.cached_tokens == 0
    history = turn1 + out1.token_ids
    turn2 = history + prompt(loaded, " User: and the mountains?")
    out2 = eng.generate([turn2], GREEDY)[0]
    computed = len(history) - 1  # the last sampled token never had its K/V written
    assert out2.cached_tokens == computed // 8 * 8 > len(turn1) - 8
    assert eng.cached_prefix_tokens(turn2) >= out2.cached_tokens
    assert eng.cache.stats.hit_tokens >= out2.cached_tokens


def test_tenants_do_not_share(loaded: LoadedModel) -> None:
    eng = engine(loaded)
    p = prompt(loaded, "a shared system prompt that is long enough to fill blocks")
    eng.generate([p], GREEDY, tenant_salt=b"tenant-a")
    assert eng.cached_prefix_tokens(p, tenant_salt=b"tenant-a") > 0
    assert eng.cached_prefix_tokens(p, tenant_salt=b"tenant-b") == 0
    assert eng.generate([p], GREEDY, tenant_salt=b"tenant-b")[0].cached_tokens == 0


def test_seeded_sampling_reproducible_across_batches(loaded: LoadedModel) -> None:
    p = prompt(loaded, "Random words:")
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.95, seed=7, ignore_eos=True)
    alone = engine(loaded).generate([p], params)[0].token_ids
    others = [prompt(loaded, "something else entirely"), prompt(loaded, "and another one")]
    batch = engine(loaded).generate([others[0], p, others[1]], [GREEDY, params, params])
    assert batch[1].token_ids == alone


def test_export_import_into_fresh_engine(loaded: LoadedModel) -> None:
    src = engine(loaded)
    p = prompt(loaded, "The history of the kingdom began long ago, when the first kings ruled the land.")
    ref = src.generate([p], GREEDY)[0]
    hashes = src.block_hashes(p)
    blocks = src.export_blocks(hashes)
    assert len(blocks) == len(hashes) and blocks[0].parent_hash is None
    assert blocks[1].parent_hash == blocks[0].block_hash and blocks[0].data.device.type == "cpu"
    dst = engine(loaded)
    assert dst.import_blocks(blocks) == len(blocks)
    assert dst.import_blocks(blocks) == 0  # already there
    assert dst.cached_prefix_tokens(p) == len(hashes) * 8
    assert torch.equal(dst.export_blocks(hashes)[0].data, blocks[0].data)
    out = dst.generate([p], GREEDY)[0]
    assert out.token_ids == ref.token_ids and out.cached_tokens > 0


def test_import_rejects_bad_chains(loaded: LoadedModel) -> None:
    src = engine(loaded)
    p = prompt(loaded, "Another prompt with enough tokens to fill a few blocks of eight, surely.")
    src.generate([p], GREEDY)
    blocks = src.export_blocks(src.block_hashes(p))
    assert len(blocks) >= 3
    assert engine(loaded).import_blocks(blocks[1:]) == 0  # parent missing
    assert engine(loaded).import_blocks(blocks, tenant_salt=b"other") == 0  # hash does not verify
    tampered = list(blocks)
    b = tampered[1]
    tampered[1] = type(b)(b.block_hash, b.parent_hash, (b.token_ids[0] + 1,) + b.token_ids[1:], b.data)
    assert engine(loaded).import_blocks(tampered) == 1  # stops at the first bad block


class EventLog:
    def __init__(self) -> None:
        self.stored: list[tuple[bytes, bytes | None, int]] = []
        self.removed: list[bytes] = []

    def block_stored(self, block_hash: bytes, parent_hash: bytes | None, num_tokens: int) -> None:
        self.stored.append((block_hash, parent_hash, num_tokens))

    def block_removed(self, block_hash: bytes) -> None:
        self.removed.append(block_hash)


def test_kv_events_and_side_effect_free_lookup(loaded: LoadedModel) -> None:
    log = EventLog()
    eng = Engine(loaded, EngineSettings(block_size=8, num_blocks=8), listener=log)
    p = list(range(10, 34))  # 3 full blocks
    eng.generate([p], SamplingParams(max_tokens=4, ignore_eos=True))
    hashes = eng.block_hashes(p)
    assert [s[0] for s in log.stored[:3]] == hashes
    assert [s[1] for s in log.stored[:3]] == [None, hashes[0], hashes[1]]
    assert all(s[2] == 8 for s in log.stored)
    before = (eng.cache.stats.queries, eng.cache.stats.hit_tokens)
    assert eng.cached_prefix_tokens(p) == 24
    assert (eng.cache.stats.queries, eng.cache.stats.hit_tokens) == before
    eng.generate([list(range(500, 556))], SamplingParams(max_tokens=4, ignore_eos=True))  # needs the whole pool
    assert set(hashes) <= set(log.removed) and eng.cache.stats.evictions >= 3
    assert eng.cached_prefix_tokens(p) == 0
