"""The default model, imported from its GGUF file, answers exactly as HF transformers does on that same file.

Transformers dequantizes the GGUF and undoes llama.cpp's q/k permutation its own way, so equal greedy
tokens check kvmesh's import (names, permutation, tied embeddings, config) and its engine at once, here
through a cold prefill, a prefix hit, and a prefix restored from L3 (a real S3 server) into an engine whose
pool is empty.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from kvmesh.config import EngineSettings
from kvmesh.engine.engine import Engine
from kvmesh.engine.gguf_import import import_gguf
from kvmesh.engine.loader import LoadedModel, load_model
from kvmesh.engine.sampling import SamplingParams
from kvmesh.stack.model import bundled_gguf
from kvmesh.tiers.block_format import encode_kv_block
from kvmesh.tiers.l3_store import L3Store
from kvmesh.tiers.s3_client import fast_fail_client
from transformers import AutoModelForCausalLM, AutoTokenizer

NEW_TOKENS = 16
SYSTEM = "You are a helpful assistant. Answer briefly."
QUESTIONS = ("What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea.")
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, detokenize=False)


@dataclass
class Pair:
    loaded: LoadedModel
    hf: torch.nn.Module
    hf_tokenizer: object

    def prompt(self, question: str, history: tuple[tuple[str, str], ...] = ()) -> list[int]:
        messages = [{"role": "system", "content": SYSTEM}]
        for q, a in history:
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        messages.append({"role": "user", "content": question})
        return self.loaded.tokenizer.encode(self.loaded.tokenizer.apply_chat_template(messages))

    def reference(self, ids: list[int]) -> list[int]:
        with torch.no_grad():
            out = self.hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
        return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    gguf = bundled_gguf()
    out = tmp_path_factory.mktemp("smollm2")
    import_gguf(gguf, out)
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    yield Pair(load_model(out), hf, AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name))


def engine(loaded: LoadedModel) -> Engine:
    return Engine(loaded, EngineSettings(block_size=16, num_blocks=256))


def test_greedy_tokens_equal_transformers_on_the_same_gguf(pair: Pair) -> None:
    prompts = [pair.prompt(q) for q in QUESTIONS]
    outs = engine(pair.loaded).generate(prompts, GREEDY)  # one batch: three prefills side by side
    assert [o.token_ids for o in outs] == [pair.reference(p) for p in prompts]
    first = pair.loaded.tokenizer.decode(outs[0].token_ids)
    assert "Paris" in first  # a real model answers, not noise


def test_a_prefix_hit_still_gives_transformers_tokens(pair: Pair) -> None:
    e = engine(pair.loaded)
    first = pair.prompt(QUESTIONS[0])
    answer = pair.loaded.tokenizer.decode(e.generate([first], GREEDY)[0].token_ids)
    follow_up = pair.prompt("And of Italy?", history=((QUESTIONS[0], answer),))
    out = e.generate([follow_up], GREEDY)[0]
    assert out.cached_tokens >= 16 * (len(first) // 16) - 16  # the first turn's blocks, served from the pool
    assert out.token_ids == pair.reference(follow_up)


def test_a_prefix_restored_from_l3_gives_transformers_tokens(pair: Pair, s3_server, tmp_path: Path) -> None:
    loaded = pair.loaded
    prompt = pair.prompt(QUESTIONS[2])
    source = engine(loaded)
    source.generate([prompt], GREEDY)
    hashes = source.block_hashes(prompt)
    client = fast_fail_client(s3_server.endpoint, s3_server.access_key, s3_server.secret_key)
    store = L3Store(client, "kvmesh-parity", loaded.fingerprint, chunk_blocks=2)
    store.ensure_bucket()
    store.put_chain("parity", [encode_kv_block(b, loaded.fingerprint) for b in source.export_blocks(hashes)])

    fresh = engine(loaded)  # nothing in its pool
    restored = store.load_prefix("parity", hashes)
    assert len(restored) == len(hashes) > 0
    assert fresh.import_blocks([b.to_kv_block() for b in restored]) == len(hashes)
    out = fresh.generate([prompt], GREEDY)[0]
    assert out.cached_tokens == 16 * len(hashes)
    assert out.token_ids == pair.reference(prompt)


def test_the_tokenizer_agrees_with_transformers_and_splits_digits(pair: Pair) -> None:
    ours = pair.loaded.tokenizer
    texts = [ours.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    texts += ["def add(a, b):\n    return a + b  # résumé, naïve café", "<|im_start|>user\nhi<|im_end|>"]
    for text in texts:  # digit-free: transformers' GGUF tokenizer does not split digits the way SmolLM's does
        assert ours.encode(text) == pair.hf_tokenizer.encode(text, add_special_tokens=False), text
    digits = ours.encode("2024")
    assert len(digits) == 4 and ours.decode(digits) == "2024"  # llama.cpp's `smollm` split: one digit a token
    im_start = ours.token_to_id("<|im_start|>")
    assert ours.encode("<|im_start|>") == [im_start] and ours.decode([im_start]) == ""  # special, dropped
