"""Synthetic presets: a real byte-level tokenizer, the chat template, separated logits, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvmesh.cli.main import app
from kvmesh.engine.chat_template import ChatTemplateError
from kvmesh.engine.forward_batch import ForwardBatch
from kvmesh.engine.loader import load_model
from kvmesh.engine.synthetic_tokenizer import SPECIAL_TOKENS
from kvmesh.engine.tokenizer import Tokenizer
from typer.testing import CliRunner


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


@settings(max_examples=200, deadline=None)
@given(text=st.text())
def test_any_text_round_trips(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    # Special-token strings in text are matched as special tokens (as in HF),
    # so only the keep-specials decode is exact for every input.
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    if not any(token in text for token in SPECIAL_TOKENS):
        assert tokenizer.decode(ids) == text


def test_bpe_merges_common_words_and_specials_are_single_ids(tokenizer: Tokenizer) -> None:
    assert len(tokenizer.encode(" the agent calls the tool")) <= 6  # merged words, not bytes
    assert tokenizer.encode("") == []
    for token in SPECIAL_TOKENS:
        assert tokenizer.encode(token) == [tokenizer.token_to_id(token)]
    eot = tokenizer.token_to_id("<|eot_id|>")
    hello = tokenizer.encode("hello")
    assert tokenizer.decode(hello + [eot]) == "hello"
    assert tokenizer.decode(hello + [eot], skip_special_tokens=False) == "hello<|eot_id|>"


def test_chat_template_renders_a_tool_conversation(tokenizer: Tokenizer) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"}]},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}],
        },
        {"role": "tool", "content": '{"temp_c": 4}'},
        {"role": "assistant", "content": "4 °C."},
        {"role": "user", "content": "Thanks"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=tools)
    head = "<|start_header_id|>{}<|end_header_id|>\n\n"
    assert text.startswith("<|begin_of_text|>" + head.format("system"))
    assert '"name": "get_weather"' in text and "You are terse.<|eot_id|>" in text
    assert head.format("user") + "Weather in Oslo?<|eot_id|>" in text
    assert head.format("assistant") + '{"name": "get_weather", "parameters": {"city": "Oslo"}}<|eot_id|>' in text
    assert head.format("ipython") + '{"temp_c": 4}<|eot_id|>' in text
    assert head.format("assistant") + "4 °C.<|eot_id|>" in text
    assert text.endswith(head.format("user") + "Thanks<|eot_id|>" + head.format("assistant"))
    no_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    assert no_prompt.endswith("Thanks<|eot_id|>") and "get_weather" not in no_prompt.split("Weather")[0]
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id and tokenizer.decode(ids, skip_special_tokens=False) == text


def test_same_text_and_ids_as_transformers(tokenizer: Tokenizer, tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "hi é 😀"},
        {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"a": [1, "é"]}}}]},
        {"role": "tool", "content": "r1"},
    ]
    ours = tokenizer.apply_chat_template(messages, tools=tools)
    assert ours == hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert tokenizer.encode(ours) == hf.encode(ours, add_special_tokens=False)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_ids) == (hf.bos_token_id, (hf.eos_token_id,))


def test_chat_template_rejects_unknown_role(tokenizer: Tokenizer) -> None:
    with pytest.raises(ChatTemplateError, match="unsupported role: narrator"):
        tokenizer.apply_chat_template([{"role": "narrator", "content": "x"}])


def _last_logits(model_dir: Path, prompts: torch.Tensor) -> torch.Tensor:
    """Last-token logits of each row of `prompts` [P, L], all prefilled in one batch."""
    loaded = load_model(model_dir)
    cfg = loaded.config
    n, length = prompts.shape
    block = 32  # each prompt in one block of its own
    kv = torch.zeros(cfg.num_layers, 2, n, block, cfg.num_kv_heads, cfg.head_dim)
    batch = ForwardBatch(
        input_ids=prompts.reshape(-1),
        positions=torch.arange(length).repeat(n),
        query_lens=torch.full((n,), length, dtype=torch.int32),
        context_lens=torch.full((n,), length, dtype=torch.int32),
        block_tables=torch.arange(n, dtype=torch.int32).unsqueeze(1),
        slot_mapping=(torch.arange(n).unsqueeze(1) * block + torch.arange(length)).reshape(-1),
        logits_indices=torch.arange(1, n + 1) * length - 1,
    )
    return loaded.model(batch, kv)


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_qwen2_model_dir"])
def test_logits_are_well_separated_and_depend_on_context(fixture: str, request: pytest.FixtureRequest) -> None:
    model_dir = request.getfixturevalue(fixture)
    vocab = load_model(model_dir).config.vocab_size
    prompts = torch.randint(0, vocab, (48, 24), generator=torch.Generator().manual_seed(11))
    logits = _last_logits(model_dir, prompts)
    top2 = logits.topk(2, dim=-1)
    gaps = top2.values[:, 0] - top2.values[:, 1]
    # fp32 noise from reordered sums is ~1e-5 here; the typical margin must dwarf it.
    assert gaps.median() > 0.1
    assert (gaps > 1e-3).float().mean() > 0.9
    # Not a degenerate echo of the last input token (tied embeddings invite that) ...
    assert (top2.indices[:, 0] == prompts[:, -1]).float().mean() < 0.25
    # ... and the earlier context moves the answer, so a wrong cached prefix would show.
    other = prompts.clone()
    other[:, :12] = torch.randint(0, vocab, (48, 12), generator=torch.Generator().manual_seed(12))
    changed = _last_logits(model_dir, other).argmax(-1) != top2.indices[:, 0]
    assert changed.float().mean() > 0.5


def test_cli_model_init_writes_a_loadable_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "qwen-bf16"
    args = ["model", "init", "--preset", "tiny", "--arch", "qwen2", "--dtype", "bfloat16", "--seed", "5", "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    loaded = load_model(out)
    assert summary["fingerprint"] == loaded.fingerprint
    assert summary["architecture"] == "Qwen2ForCausalLM" and summary["dtype"] == "bfloat16"
    assert loaded.config.dtype == torch.bfloat16
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).is_file(), name


def test_cli_model_init_rejects_unknown_preset(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["model", "init", "--preset", "huge", "--out", str(tmp_path / "x")])
    assert result.exit_code != 0 and "unknown preset 'huge'" in result.output
