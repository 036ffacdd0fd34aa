"""`kvmesh generate`: one in-process engine over prompts in order, one JSON line per prompt.

Prompts run one after another through the same engine, so a later prompt
hits the blocks an earlier one left in the cache (`cached_tokens`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer


def read_prompts_file(path: Path) -> list[dict[str, Any]]:
    """Each line: {"prompt": "text"} or {"prompt_ids": [ints]}; ValueError naming the bad line."""
    entries: list[dict[str, Any]] = []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(obj, dict) or ("prompt" in obj) == ("prompt_ids" in obj):
            raise ValueError(f'{path}:{lineno}: expected an object with exactly one of "prompt" or "prompt_ids"')
        if "prompt" in obj and not isinstance(obj["prompt"], str):
            raise ValueError(f'{path}:{lineno}: "prompt" must be a string')
        ids = obj.get("prompt_ids")
        if ids is not None and not (
            isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)
        ):
            raise ValueError(f'{path}:{lineno}: "prompt_ids" must be a list of non-negative integers')
        entries.append(obj)
    if not entries:
        raise ValueError(f"{path}: no prompts")
    return entries


def generate(
    model: Annotated[Path, typer.Option(help="HF-format checkpoint dir.")],
    prompts_file: Annotated[Path | None, typer.Option(help='JSONL: {"prompt": text} or {"prompt_ids": [...]} per line.')] = None,
    prompt: Annotated[str | None, typer.Option(help="A single prompt (tokenized as is, no chat template).")] = None,
    max_tokens: Annotated[int, typer.Option(help="Tokens to generate per prompt.")] = 32,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    seed: Annotated[int | None, typer.Option(help="Sampling seed (per request).")] = None,
    block_size: Annotated[int, typer.Option(help="KV block size in tokens.")] = 16,
    prefix_cache: Annotated[bool, typer.Option(help="Reuse cached prefix blocks.")] = True,
) -> None:
    """Run prompts in order through one engine; print text, token_ids, prompt_tokens, cached_tokens per prompt."""
    if (prompts_file is None) == (prompt is None):
        raise typer.BadParameter("give exactly one of --prompts-file or --prompt")
    try:
        entries = read_prompts_file(prompts_file) if prompts_file is not None else [{"prompt": prompt}]
    except (OSError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None

    from kvmesh.config import load_settings
    from kvmesh.engine.engine import Engine
    from kvmesh.engine.loader import load_model
    from kvmesh.engine.sampling import SamplingParams

    settings = load_settings().engine.model_copy(update={"block_size": block_size, "enable_prefix_caching": prefix_cache})
    loaded = load_model(model)
    engine = Engine(loaded, settings)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
    for lineno, entry in enumerate(entries, start=1):
        ids = entry["prompt_ids"] if "prompt_ids" in entry else loaded.tokenizer.encode(entry["prompt"])
        try:
            out = engine.generate([ids], params)[0]
        except ValueError as exc:
            typer.echo(f"error: prompt {lineno}: {exc}", err=True)
            raise typer.Exit(2) from None
        record = {
            "text": out.text,
            "token_ids": out.token_ids,
            "prompt_tokens": out.prompt_tokens,
            "cached_tokens": out.cached_tokens,
            "finish_reason": out.finish_reason,
        }
        typer.echo(json.dumps(record))
