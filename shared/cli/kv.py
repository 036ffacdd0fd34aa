"""`kvmesh kv convert|export|import`: move KV between engines, layouts, dtypes and block sizes.

A KV file is safetensors (shared/kvconvert/safetensors_io.py). `export`
computes prompts' KV with the in-process engine and writes it; `convert`
rewrites a file (layout, dtype, block size with recomputed hashes);
`import` puts a file's chains into L3 so a running stack finds them.
Incompatibilities exit with code 2 and a one-line reason.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(help="KV format migration: layout, dtype, block size, safetensors.", no_args_is_help=True)

SaltOpt = Annotated[str, typer.Option(help="Tenant salt as hex (the hash key the blocks were made with).")]


def _fail(exc: Exception) -> typer.Exit:
    typer.echo(f"error: {exc}", err=True)
    return typer.Exit(2)


@app.command()
def convert(
    src: Annotated[Path, typer.Argument(help="Input KV safetensors file.")],
    dst: Annotated[Path, typer.Argument(help="Output KV safetensors file.")],
    layout: Annotated[str | None, typer.Option(help="NHD or HND.")] = None,
    dtype: Annotated[str | None, typer.Option(help="float32, bfloat16 or float16.")] = None,
    block_size: Annotated[int | None, typer.Option(help="Target tokens per block (a multiple or divisor).")] = None,
    tenant_salt: SaltOpt = "",
    adapter: Annotated[str, typer.Option(help="Adapter name the blocks were hashed with.")] = "",
) -> None:
    """Rewrite a KV file in another layout, dtype and/or block size."""
    from kvmesh.kvconvert.errors import IncompatibleKV
    from kvmesh.kvconvert.safetensors_io import export_safetensors, import_safetensors
    from kvmesh.kvconvert.transform import convert_dtype, convert_layout, rechunk
    from kvmesh.protocol.block_hash import HashKeys

    try:
        blocks = import_safetensors(src)
        dropped = 0
        if block_size is not None and blocks:
            keys = HashKeys(blocks[0].header.fingerprint, bytes.fromhex(tenant_salt), adapter)
            result = rechunk(blocks, block_size, keys)
            blocks, dropped = result.blocks, result.dropped_tokens
        if layout is not None:
            blocks = [convert_layout(b, layout) for b in blocks]
        if dtype is not None:
            blocks = [convert_dtype(b, dtype) for b in blocks]
        export_safetensors(blocks, dst)
    except (IncompatibleKV, OSError, ValueError) as exc:
        raise _fail(exc) from None
    h = blocks[0].header
    typer.echo(f"wrote {len(blocks)} blocks ({h.block_size} tokens, {h.layout}, {h.dtype}) to {dst}"
               + (f"; dropped {dropped} tail tokens that fill no whole block" if dropped else ""))


@app.command("export")
def export_cmd(
    model: Annotated[Path, typer.Option(help="HF-format checkpoint dir.")],
    prompts_file: Annotated[Path, typer.Option(help='JSONL: {"prompt": text} or {"prompt_ids": [...]} per line.')],
    out: Annotated[Path, typer.Option(help="Output KV safetensors file.")],
    block_size: Annotated[int, typer.Option(help="KV block size in tokens.")] = 16,
    tenant_salt: SaltOpt = "",
) -> None:
    """Prefill each prompt with the in-process engine and write the full blocks' KV."""
    from kvmesh.cli.generate import read_prompts_file
    from kvmesh.config import load_settings
    from kvmesh.engine.engine import Engine
    from kvmesh.engine.loader import load_model
    from kvmesh.engine.sampling import SamplingParams
    from kvmesh.kvconvert.safetensors_io import export_safetensors
    from kvmesh.tiers.block_format import StoredBlock, header_for

    try:
        entries = read_prompts_file(prompts_file)
    except (OSError, ValueError) as exc:
        raise _fail(exc) from None
    loaded = load_model(model)
    engine = Engine(loaded, load_settings().engine.model_copy(update={"block_size": block_size}))
    salt = bytes.fromhex(tenant_salt)
    blocks: list[StoredBlock] = []
    for entry in entries:
        ids = entry["prompt_ids"] if "prompt_ids" in entry else loaded.tokenizer.encode(entry["prompt"])
        engine.generate([ids], SamplingParams(max_tokens=1, detokenize=False), tenant_salt=salt)
        blocks += [StoredBlock(header_for(kb, loaded.fingerprint), kb.data)
                   for kb in engine.export_blocks(engine.block_hashes(ids, salt))]
    if not blocks:
        raise _fail(ValueError(f"no prompt fills one block of {block_size} tokens: nothing to export"))
    export_safetensors(blocks, out)
    typer.echo(f"wrote {len(blocks)} blocks of {len(entries)} prompts to {out}")


@app.command("import")
def import_cmd(
    src: Annotated[Path, typer.Argument(help="KV safetensors file.")],
    namespace: Annotated[str, typer.Option(help="L3 namespace (tenant-derived) to store under.")],
    model: Annotated[Path | None, typer.Option(help="Refuse the file unless it is this checkpoint's KV.")] = None,
    endpoint: Annotated[str | None, typer.Option(help="S3 host:port; default from settings / the local stack.")] = None,
) -> None:
    """Upload a KV file's chains into L3 (idempotent: chunks already there are skipped)."""
    from kvmesh.config import load_settings
    from kvmesh.credentials.s3 import read_credentials
    from kvmesh.kvconvert.errors import IncompatibleKV
    from kvmesh.kvconvert.safetensors_io import import_safetensors
    from kvmesh.kvconvert.transform import convert_layout, split_chains
    from kvmesh.tiers.block_format import encode_block
    from kvmesh.tiers.l3_store import S3_DOWN_ERRORS, L3Store, L3Unavailable
    from kvmesh.tiers.s3_client import fast_fail_client

    settings = load_settings()
    try:
        fingerprint = None
        if model is not None:
            from kvmesh.engine.loader import load_model

            fingerprint = load_model(model).fingerprint
        blocks = import_safetensors(src, fingerprint)
    except (IncompatibleKV, OSError, ValueError) as exc:
        raise _fail(exc) from None
    if not blocks:
        raise _fail(ValueError(f"{src}: no blocks"))
    creds = read_credentials(settings.state_dir.resolve())
    access = settings.s3_access_key or (creds.access_key if creds else None)
    secret = settings.s3_secret_key or (creds.secret_key if creds else None)
    if not (access and secret):
        raise _fail(ValueError("no S3 credentials: set KVMESH_S3_ACCESS_KEY/SECRET_KEY or run `kvmesh up`"))
    endpoint = endpoint or settings.s3_endpoint or f"{settings.s3.host}:{settings.s3.port}"
    fp = blocks[0].header.fingerprint
    chunk_blocks = max(1, settings.tiers.l3_chunk_tokens // blocks[0].header.block_size)
    store = L3Store(fast_fail_client(endpoint, access, secret, settings.s3_secure), settings.s3.bucket, fp, chunk_blocks)
    try:
        store.ensure_bucket()
        for chain in split_chains(blocks):
            nhd = [convert_layout(b, "NHD") for b in chain]  # L3 holds what engines import
            store.put_chain(namespace, [encode_block(b.header, b.data) for b in nhd])
    except (L3Unavailable, ValueError, *S3_DOWN_ERRORS) as exc:
        raise _fail(exc) from None
    typer.echo(f"stored {len(blocks)} blocks: {store.stats.chunks_written} chunks written, "
               f"{store.stats.chunks_skipped} already present, under {fp[:12]}../{namespace}/ in {settings.s3.bucket}")
