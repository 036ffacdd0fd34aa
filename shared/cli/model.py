"""`kvmesh model init|info`: import a GGUF file or write a seeded synthetic checkpoint; describe one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(help="Checkpoints: import a GGUF file, write a synthetic one, describe one.", no_args_is_help=True)


def _describe(model_dir: Path) -> dict:
    from kvmesh.engine.loader import load_model

    loaded = load_model(model_dir)
    cfg = loaded.config
    return {
        "path": str(model_dir),
        "architecture": cfg.architecture,
        "dtype": cfg.dtype_name,
        "kv_dtype": str(cfg.kv_dtype).removeprefix("torch."),
        "parameters": sum(p.numel() for p in loaded.model.parameters()),
        "vocab_size": cfg.vocab_size,
        "num_layers": cfg.num_layers,
        "kv_bytes_per_token": cfg.kv_bytes_per_token(),
        "fingerprint": loaded.fingerprint,
    }


@app.command()
def init(
    out: Annotated[Path, typer.Option(help="Directory to write the checkpoint into.")],
    gguf: Annotated[Path | None, typer.Option(
        help="Import this GGUF file (Llama or Qwen2; F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) instead of "
             "writing a preset; --dtype applies, --preset/--arch/--seed/--shards do not.")] = None,
    preset: Annotated[str, typer.Option(help="tiny (tests), agent (tiny with 32k positions), small (benchmarks), llama3-8b or llama3-70b (real KV geometry).")] = "tiny",
    arch: Annotated[str, typer.Option(help="llama or qwen2.")] = "llama",
    dtype: Annotated[str, typer.Option(help="float32 or bfloat16.")] = "float32",
    seed: Annotated[int, typer.Option(help="Weight seed; same seed, same bytes.")] = 0,
    shards: Annotated[int, typer.Option(help="Split weights into N safetensors shards.")] = 1,
) -> None:
    """Write an HF-format checkpoint (imported from --gguf, or a seeded synthetic preset); print its summary as JSON."""
    from kvmesh.engine.checkpoint_error import CheckpointError

    try:
        if gguf is not None:
            from kvmesh.engine.gguf_import import import_gguf

            import_gguf(gguf, out, dtype)
        else:
            from kvmesh.engine.presets import write_preset

            write_preset(out, preset, arch, dtype, seed, num_shards=shards)
    except CheckpointError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    typer.echo(json.dumps(_describe(out)))


@app.command()
def info(model_dir: Annotated[Path, typer.Argument(help="HF-format checkpoint dir.")]) -> None:
    """Load a checkpoint dir and print its geometry and fingerprint as JSON."""
    from kvmesh.engine.checkpoint_error import CheckpointError

    try:
        typer.echo(json.dumps(_describe(model_dir)))
    except CheckpointError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
