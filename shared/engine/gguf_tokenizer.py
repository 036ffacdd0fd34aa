"""A GGUF file's tokenizer, rebuilt as an HF `tokenizers` byte-level BPE.

GGUF stores a BPE vocabulary as three parallel arrays (`tokenizer.ggml.tokens`,
`.token_type`, `.merges`) plus a name for how text is split before the merges
apply (`tokenizer.ggml.pre`). Only the byte-level BPE family (`model = gpt2`)
is rebuilt here; each known split name maps to the split its vocabulary was
trained with. Control tokens (type 3) and user-defined ones (type 4) become
added tokens, so a chat template that writes `<|im_start|>` as text encodes
to that one id, as `Tokenizer.encode` expects.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.engine.checkpoint_error import CheckpointError
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

CONTROL, USER_DEFINED = 3, 4  # GGUF token types that are matched as whole added tokens

# The splits the merges were learned on, by `tokenizer.ggml.pre` name (llama.cpp's names).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:  # SmolLM: every digit on its own, then GPT-2's split
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2()])


def _split(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


PRE_TOKENIZERS = {
    "default": _gpt2,
    "gpt2": _gpt2,
    "smollm": _digits_then_gpt2,
    "llama-bpe": lambda: _split(_LLAMA3_SPLIT),
    "llama3": lambda: _split(_LLAMA3_SPLIT),
    "qwen2": lambda: _split(_QWEN2_SPLIT),
}


@dataclass(frozen=True, slots=True)
class GGUFVocab:
    """The tokenizer fields of one GGUF file, already decoded to Python values."""

    model: str  # tokenizer.ggml.model
    pre: str  # tokenizer.ggml.pre ("default" when absent)
    tokens: list[str]
    token_types: list[int]
    merges: list[str]  # "a b" pairs, in rank order


def build_tokenizer(vocab: GGUFVocab) -> HFTokenizer:
    """The byte-level BPE tokenizer of `vocab`; CheckpointError names what is not supported."""
    if vocab.model != "gpt2":
        raise CheckpointError(f"GGUF tokenizer model {vocab.model!r} is not supported (only byte-level BPE, 'gpt2')")
    if vocab.pre not in PRE_TOKENIZERS:
        raise CheckpointError(f"GGUF pre-tokenizer {vocab.pre!r} is not supported "
                              f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})")
    if len(vocab.token_types) != len(vocab.tokens):
        raise CheckpointError("GGUF tokenizer: token_type and tokens differ in length")
    ids = {token: i for i, token in enumerate(vocab.tokens)}
    merges = [tuple(m.split(" ", 1)) for m in vocab.merges]
    if any(len(pair) != 2 for pair in merges):
        raise CheckpointError("GGUF tokenizer: a merge is not two space-separated tokens")
    tok = HFTokenizer(models.BPE(ids, merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = PRE_TOKENIZERS[vocab.pre]()
    tok.decoder = decoders.ByteLevel()
    pairs = list(zip(vocab.tokens, vocab.token_types, strict=True))
    # Already in the vocab, so their ids stay; now they are matched whole (control ones dropped by decode).
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, kind in pairs if kind == CONTROL])
    tok.add_tokens([AddedToken(t, normalized=False) for t, kind in pairs if kind == USER_DEFINED])
    return tok
