"""`kvmesh bench grammar-libs`: llguidance vs xgrammar on kvmesh's own tokenizers.

What a worker pays for a constrained request, per library, on the same
grammar and the same token sequence:
- `tokenizer_ms`: building the library's view of the vocab (once per worker);
- `compile_ms`: one grammar (a nested JSON schema with enums and arrays; a
  3-tool Hermes call, one call of any of the tools) -- once per new schema;
- `mask_us` / `advance_us`: median per-token mask fill and token accept
  while walking a valid document's tokens (what every decode step adds).
The tokenizers are the synthetic byte-level BPEs of the presets (tiny: 1024,
small: 8192) plus a 32000 one, trained here. This bench chose llguidance
(docs/constrained-decoding.md); it imports both libraries directly, which
nothing under shared/ does.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass

import numpy as np
from kvmesh.engine.synthetic_tokenizer import EOS, EOT, train_tokenizer
from rich.console import Console

SEPARATORS = (", ", ": ")

SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "integer", "minimum": 0, "maximum": 10**9},
        "status": {"enum": ["open", "paid", "shipped", "cancelled"]},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 64},
                "tier": {"enum": ["free", "pro", "enterprise"]},
                "address": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 64},
                                   "zip": {"type": "string", "maxLength": 10}},
                    "required": ["city", "zip"], "additionalProperties": False,
                },
            },
            "required": ["name", "tier", "address"], "additionalProperties": False,
        },
        "items": {
            "type": "array", "maxItems": 8,
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string", "maxLength": 16},
                               "qty": {"type": "integer", "minimum": 1, "maximum": 1000}},
                "required": ["sku", "qty"], "additionalProperties": False,
            },
        },
    },
    "required": ["order_id", "status", "customer", "items"], "additionalProperties": False,
}
DOCUMENT = {
    "order_id": 48213, "status": "shipped",
    "customer": {"name": "Ada Lovelace", "tier": "pro", "address": {"city": "London", "zip": "NW1 6XE"}},
    "items": [{"sku": "kv-cache-01", "qty": 2}, {"sku": "prefix-tree", "qty": 1}, {"sku": "block-pool", "qty": 12}],
}
TOOLS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 64},
                                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
                    "required": ["city", "unit"], "additionalProperties": False},
    "search_files": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 64},
                                                      "limit": {"type": "integer", "minimum": 1, "maximum": 100}},
                     "required": ["query", "limit"], "additionalProperties": False},
    "send_message": {"type": "object", "properties": {"to": {"type": "string", "maxLength": 64},
                                                      "body": {"type": "string", "maxLength": 64}},
                     "required": ["to", "body"], "additionalProperties": False},
}
CALL_OPEN, CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"
CALL_TEXT = CALL_OPEN + json.dumps({"name": "search_files", "arguments": {"query": "prefix cache", "limit": 5}}) + CALL_CLOSE


def _call_schema(name: str, params: dict) -> dict:
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


@dataclass(slots=True)
class Vocab:
    name: str
    tokenizer_json: str
    tokens: list[str]  # byte-level token strings by id
    eos: list[int]
    encode: object


def _vocab(size: int) -> Vocab:
    tok = train_tokenizer(size)
    by_id = sorted(tok.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
    return Vocab(f"bpe{tok.get_vocab_size()}", tok.to_str(), [t for t, _ in by_id],
                 [tok.token_to_id(EOS), tok.token_to_id(EOT)], lambda s: tok.encode(s, add_special_tokens=False).ids)


def _ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1000, 3)


def _walk(ids: list[int], mask, advance) -> dict:
    masks, advances = [], []
    for tok in ids:
        t0 = time.perf_counter()
        mask()
        t1 = time.perf_counter()
        ok = advance(tok)
        masks.append(t1 - t0)
        advances.append(time.perf_counter() - t1)
        if not ok:
            raise RuntimeError("the library rejected a token of a valid document")
    return {"mask_us": round(statistics.median(masks) * 1e6, 2), "advance_us": round(statistics.median(advances) * 1e6, 2),
            "mask_p90_us": round(sorted(masks)[int(0.9 * len(masks))] * 1e6, 2), "tokens": len(ids)}


def _llguidance(v: Vocab) -> dict:
    import llguidance as llg

    opts = {"whitespace_flexible": False, "item_separator": SEPARATORS[0], "key_separator": SEPARATORS[1]}
    t0 = time.perf_counter()
    tok = llg.LLTokenizer(v.tokenizer_json, n_vocab=len(v.tokens), eos_token=v.eos)
    out: dict = {"tokenizer_ms": _ms(t0)}
    alts = " | ".join(f"t{i}" for i in range(len(TOOLS)))
    rules = "\n".join(f"t{i}: %json{json.dumps({**_call_schema(n, p), 'x-guidance': opts})}"
                      for i, (n, p) in enumerate(TOOLS.items()))
    lark = f"start: {json.dumps(CALL_OPEN)} call {json.dumps(CALL_CLOSE)}\ncall: {alts}\n{rules}\n"
    cases = {"json_schema": (llg.LLMatcher.grammar_from_json_schema(SCHEMA, overrides=opts), json.dumps(DOCUMENT)),
             "tool_call": (llg.LLMatcher.grammar_from_lark(lark), CALL_TEXT)}
    bitmask = np.zeros((len(v.tokens) + 31) // 32, dtype=np.int32)
    for case, (grammar, text) in cases.items():
        t0 = time.perf_counter()
        m = llg.LLMatcher(tok, grammar)
        compile_ms = _ms(t0)
        if m.is_error():
            raise RuntimeError(m.get_error())
        walk = _walk(v.encode(text), lambda: m.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes),
                     m.consume_token)
        out[case] = {"compile_ms": compile_ms, **walk}
    return out


def _xgrammar(v: Vocab) -> dict:
    import torch
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(v.tokens, xgr.VocabType.BYTE_LEVEL, vocab_size=len(v.tokens), stop_token_ids=v.eos)
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    out: dict = {"tokenizer_ms": _ms(t0)}
    call = xgr.Grammar.union(*(xgr.Grammar.from_json_schema(_call_schema(n, p), any_whitespace=False, separators=SEPARATORS)
                               for n, p in TOOLS.items()))
    tool = xgr.Grammar.concat(xgr.Grammar.from_ebnf(f"root ::= {json.dumps(CALL_OPEN)}"), call,
                              xgr.Grammar.from_ebnf(f"root ::= {json.dumps(CALL_CLOSE)}"))
    bitmask = xgr.allocate_token_bitmask(1, len(v.tokens))
    for case, compile_fn, text in (
        ("json_schema", lambda: compiler.compile_json_schema(SCHEMA, any_whitespace=False, separators=SEPARATORS),
         json.dumps(DOCUMENT)),
        ("tool_call", lambda: compiler.compile_grammar(tool), CALL_TEXT),
    ):
        t0 = time.perf_counter()
        compiled = compile_fn()
        compile_ms = _ms(t0)
        m = xgr.GrammarMatcher(compiled)
        with torch.inference_mode():
            walk = _walk(v.encode(text), lambda: m.fill_next_token_bitmask(bitmask), m.accept_token)
        out[case] = {"compile_ms": compile_ms, **walk}
    return out


def run_grammar_libs_bench(vocab_sizes: tuple[int, ...] = (1024, 8192, 32000)) -> dict:
    console = Console(stderr=True)
    result: dict = {"separators": list(SEPARATORS), "vocabs": {}}
    for size in vocab_sizes:
        console.log(f"training a {size}-token byte-level BPE")
        v = _vocab(size)
        console.log(f"{v.name}: llguidance")
        lg = _llguidance(v)
        console.log(f"{v.name}: xgrammar")
        xg = _xgrammar(v)
        ratios = {f"{case}_{k}_xgr_over_llg": round(xg[case][k] / max(lg[case][k], 1e-9), 2)
                  for case in ("json_schema", "tool_call") for k in ("compile_ms", "mask_us", "advance_us")}
        result["vocabs"][v.name] = {"llguidance": lg, "xgrammar": xg, **ratios}
    return result
