"""Sampling masks, seeded reproducibility, and stop strings / UTF-8 in detokenization."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kvmesh.engine.detokenizer import IncrementalDetokenizer
from kvmesh.engine.sampling import (
    SamplingParams,
    apply_top_k,
    apply_top_p,
    make_generator,
    sample,
)
from kvmesh.engine.tokenizer import Tokenizer


def test_top_k_keeps_the_k_largest() -> None:
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    out = apply_top_k(logits, 2)
    assert torch.isfinite(out).tolist() == [[False, True, False, True, False]]
    assert torch.equal(apply_top_k(logits, 0), logits)


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log()
    kept = lambda p: torch.isfinite(apply_top_p(logits, p)).tolist()  # noqa: E731
    assert kept(0.5) == [False, True, False, False]
    assert kept(0.7) == [False, True, False, True]
    assert kept(0.9) == [False, True, True, True]
    assert kept(0.01) == [False, True, False, False]  # the top token always stays
    assert kept(1.0) == [True, True, True, True]


def test_extreme_but_valid_params_still_sample() -> None:
    """Found by fuzzing the ingress: a subnormal top_p (0 in float32) or temperature made every probability nan."""
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(1))
    for params in (SamplingParams(temperature=1.0, top_p=5e-324, seed=1),
                   SamplingParams(temperature=5e-324, seed=1), SamplingParams(temperature=1e-300, top_p=1e-300)):
        assert sample(logits, [params], [make_generator(params)]) == logits.argmax(-1).tolist()


def test_sampling_respects_top_k() -> None:
    logits = torch.zeros(1, 50)
    logits[0, 7] = 1.0
    logits[0, 9] = 1.0
    params = SamplingParams(temperature=1.0, top_k=2, seed=3)
    gen = make_generator(params)
    drawn = {sample(logits, [params], [gen])[0] for _ in range(100)}
    assert drawn == {7, 9}


def test_greedy_is_argmax() -> None:
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams()] * 4
    assert sample(logits, params, [None] * 4) == logits.argmax(-1).tolist()


def test_seeded_sampling_is_independent_of_batch() -> None:
    torch.manual_seed(0)
    steps = [torch.randn(3, 200) for _ in range(10)]
    p = SamplingParams(temperature=0.8, top_p=0.9, seed=1234)
    alone_gen = make_generator(p)
    alone = [sample(s[1:2], [p], [alone_gen])[0] for s in steps]
    others = [SamplingParams(temperature=1.0, seed=9), SamplingParams()]
    gens = [make_generator(others[0]), make_generator(p), None]
    batched = [sample(s, [others[0], p, others[1]], gens)[1] for s in steps]
    assert alone == batched
    assert len(set(alone)) > 1  # it really sampled


def test_invalid_params_are_rejected() -> None:
    for bad in ({"max_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"top_k": -1}, {"stop": ("",)}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


def feed(tok: Tokenizer, text: str, stop: tuple[str, ...]) -> tuple[IncrementalDetokenizer, list[str], bool]:
    detok = IncrementalDetokenizer(tok, tok.encode("Prompt:"), stop)
    deltas, hit = [], False
    for t in tok.encode(text):
        hit = detok.add(t)
        deltas.append(detok.take_delta(finished=hit))
        if hit:
            break
    if not hit:
        deltas.append(detok.take_delta(finished=True))
    return detok, deltas, hit


def test_detokenization_matches_full_decode(tokenizer: Tokenizer) -> None:
    text = " the quick brown fox, 😀 and ünïcödé text"
    detok, deltas, hit = feed(tokenizer, text, ())
    assert not hit
    assert "".join(deltas) == detok.text == tokenizer.decode(tokenizer.encode(text))
    assert not any("\ufffd" in d for d in deltas)  # never half a UTF-8 character


def test_stop_string_spanning_tokens_truncates_before_it(tokenizer: Tokenizer) -> None:
    text = " hello world and the rest"
    stop = "lo wor"
    ids = tokenizer.encode(text)
    pieces = [tokenizer.decode([i]) for i in ids]
    assert not any(stop in p for p in pieces)  # the stop string really spans tokens
    detok, deltas, hit = feed(tokenizer, text, (stop, "never"))
    assert hit and detok.text == " hel"
    assert "".join(deltas) == " hel"  # no part of the stop string ever leaked out


def test_earliest_stop_string_wins(tokenizer: Tokenizer) -> None:
    detok, _, hit = feed(tokenizer, " alpha beta gamma", ("gamma", "beta"))
    assert hit and detok.text == " alpha "
