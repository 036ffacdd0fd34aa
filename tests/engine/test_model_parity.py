"""The paged model's logits equal HF transformers' on the same checkpoint.

Covers full prefill, prefill split over a cached first chunk, step-by-step
decode, and one mixed batch (fresh prefill + chunk over cache + decode).
Blocks are handed out in a scrambled order so block-table indexing bugs
cannot hide behind contiguous slots.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kvmesh.engine.forward_batch import ForwardBatch
from kvmesh.engine.loader import LoadedModel, load_model
from kvmesh.engine.presets import write_preset
from transformers import AutoModelForCausalLM

ATOL = 1e-4
BLOCK_SIZE = 16  # the engine default; also the smallest the Triton kernels take


class PagedRunner:
    """Just enough block bookkeeping to drive the model: per-seq tables and lengths."""

    def __init__(self, loaded: LoadedModel, num_blocks: int = 96) -> None:
        cfg = loaded.config
        self.model = loaded.model
        self.kv = torch.zeros(
            cfg.num_layers, 2, num_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim, dtype=cfg.dtype
        )
        gen = torch.Generator().manual_seed(7)
        self.free = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}

    def step(self, chunks: list[tuple[str, list[int]]]) -> torch.Tensor:
        ids, pos, slots, qlens, clens, tables, last = [], [], [], [], [], [], []
        for seq, tokens in chunks:
            table = self.tables.setdefault(seq, [])
            start = self.lens.get(seq, 0)
            for p in range(start, start + len(tokens)):
                if p // BLOCK_SIZE >= len(table):
                    table.append(self.free.pop())
                slots.append(table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
                pos.append(p)
            ids += tokens
            self.lens[seq] = start + len(tokens)
            qlens.append(len(tokens))
            clens.append(self.lens[seq])
            tables.append(table)
            last.append(len(ids) - 1)
        width = max(len(t) for t in tables)
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(pos, dtype=torch.int64),
            query_lens=torch.tensor(qlens, dtype=torch.int32),
            context_lens=torch.tensor(clens, dtype=torch.int32),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            logits_indices=torch.tensor(last, dtype=torch.int64),
        )
        return self.model(batch, self.kv)


def _tokens(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def tied_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama with tied embeddings and attention_bias (q/k/v and o_proj biases)."""
    return write_preset(
        tmp_path_factory.mktemp("tied-llama"), "tiny", "llama", seed=3,
        overrides={"tie_word_embeddings": True, "attention_bias": True},
    )


@pytest.fixture(scope="module", params=["llama", "qwen2", "tied_llama"])
def pair(request: pytest.FixtureRequest) -> tuple[LoadedModel, torch.nn.Module]:
    fixture = {"llama": "tiny_model_dir", "qwen2": "tiny_qwen2_model_dir", "tied_llama": "tied_llama_dir"}
    model_dir = request.getfixturevalue(fixture[request.param])
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    return load_model(model_dir), hf.eval()


def _hf_logits(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def test_full_prefill(pair) -> None:
    ours, hf = pair
    tokens = _tokens(37, ours.config.vocab_size, 1)
    got = PagedRunner(ours).step([("a", tokens)])
    assert got.shape == (1, ours.config.vocab_size) and got.dtype == torch.float32
    torch.testing.assert_close(got[0], _hf_logits(hf, tokens)[-1], atol=ATOL, rtol=0)


def test_split_prefill_attends_to_cached_chunk(pair) -> None:
    ours, hf = pair
    tokens = _tokens(41, ours.config.vocab_size, 2)
    runner = PagedRunner(ours)
    first = runner.step([("a", tokens[:18])])
    second = runner.step([("a", tokens[18:])])
    ref = _hf_logits(hf, tokens)
    torch.testing.assert_close(first[0], ref[17], atol=ATOL, rtol=0)
    torch.testing.assert_close(second[0], ref[-1], atol=ATOL, rtol=0)


def test_step_by_step_decode(pair) -> None:
    ours, hf = pair
    tokens = _tokens(10, ours.config.vocab_size, 3)
    runner = PagedRunner(ours)
    logits = [runner.step([("a", tokens)])[0]]
    for _ in range(6):
        tokens.append(int(logits[-1].argmax()))
        logits.append(runner.step([("a", tokens[-1:])])[0])
    ref = _hf_logits(hf, tokens)
    torch.testing.assert_close(torch.stack(logits), ref[9:], atol=ATOL, rtol=0)


def test_mixed_batch_prefill_chunk_and_decode(pair) -> None:
    ours, hf = pair
    vocab = ours.config.vocab_size
    a, b, c = _tokens(13, vocab, 4), _tokens(16, vocab, 5), _tokens(12, vocab, 6)
    runner = PagedRunner(ours)
    runner.step([("b", b[:9]), ("c", c[:11])])
    got = runner.step([("a", a), ("b", b[9:]), ("c", c[11:])])
    for row, seq in enumerate((a, b, c)):
        torch.testing.assert_close(got[row], _hf_logits(hf, seq)[-1], atol=ATOL, rtol=0)


def test_bfloat16_runs_close_to_fp32(tiny_model_dir: Path) -> None:
    fp32, bf16 = load_model(tiny_model_dir), load_model(tiny_model_dir, dtype="bfloat16")
    assert bf16.config.dtype == torch.bfloat16
    assert bf16.model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert fp32.fingerprint != bf16.fingerprint  # its KV differs, so its block hashes must too
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16, local_files_only=True)
    tokens = _tokens(30, fp32.config.vocab_size, 8)
    runner = PagedRunner(bf16)
    got = runner.step([("a", tokens[:20])])
    got = runner.step([("a", tokens[20:])])[0]
    ref32 = PagedRunner(fp32).step([("a", tokens)])[0]
    torch.testing.assert_close(got, _hf_logits(hf.eval(), tokens)[-1], atol=0.1, rtol=0)
    torch.testing.assert_close(got, ref32, atol=0.4, rtol=0)


TRITON_SCRIPT = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from test_model_parity import run_mixed_batch
from kvmesh.engine.loader import load_model
torch.save(run_mixed_batch(load_model(sys.argv[2])), sys.argv[3])
"""


def run_mixed_batch(loaded: LoadedModel) -> torch.Tensor:
    """Two steps over three sequences: prefill, chunk over cache, decode."""
    vocab = loaded.config.vocab_size
    a, b, c = _tokens(13, vocab, 4), _tokens(40, vocab, 5), _tokens(21, vocab, 6)
    runner = PagedRunner(loaded)
    first = runner.step([("b", b[:19]), ("c", c[:20])])
    return torch.cat([first, runner.step([("a", a), ("b", b[19:]), ("c", c[20:])])])


def test_triton_kernels_give_the_same_logits(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The model drives the Triton kernels (interpreted on CPU, in a fresh process) to the same logits."""
    out = tmp_path / "logits.pt"
    env = {**os.environ, "KVMESH_KERNELS": "triton", "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", TRITON_SCRIPT, str(Path(__file__).parent), str(tiny_model_dir), str(out)],
        env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    torch.testing.assert_close(torch.load(out), run_mixed_batch(load_model(tiny_model_dir)), atol=ATOL, rtol=0)
