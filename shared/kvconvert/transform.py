"""Layout, dtype and block-size conversion of verified blocks (`StoredBlock`s).

Layout and dtype change the tensor only. Re-chunking changes what a block is,
so it recomputes every hash with the chained hash of shared/protocol/block_hash.py
and the chain's hash keys (model fingerprint, tenant salt, adapter); the keys
are checked first by reproducing the source hashes. Merging needs whole
groups: a chain's tail that does not fill a target block is dropped and
reported (only full blocks travel). fp32 -> bf16/fp16 is lossy (see DTYPE_TOLERANCE).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from kvmesh.kvconvert.errors import IncompatibleKV
from kvmesh.protocol.block_hash import BlockHash, HashKeys, hash_block
from kvmesh.tiers.block_format import DTYPES, LAYOUTS, StoredBlock

# Max abs error of one fp32 -> dtype -> fp32 round trip, relative to |x| (unit roundoff).
DTYPE_TOLERANCE = {"float32": 0.0, "bfloat16": 2.0**-8, "float16": 2.0**-11}


def _token_dim(layout: str) -> int:
    return 2 if layout == "NHD" else 3


def convert_layout(block: StoredBlock, layout: str) -> StoredBlock:
    if layout not in LAYOUTS:
        raise IncompatibleKV(f"unknown layout {layout!r}: choose from {', '.join(LAYOUTS)}")
    if layout == block.header.layout:
        return block
    return StoredBlock(replace(block.header, layout=layout), block.data.transpose(2, 3).contiguous())


def convert_dtype(block: StoredBlock, dtype: str) -> StoredBlock:
    if dtype not in DTYPES:
        raise IncompatibleKV(f"unknown dtype {dtype!r}: choose from {', '.join(DTYPES)}")
    if dtype == block.header.dtype:
        return block
    return StoredBlock(replace(block.header, dtype=dtype), block.data.to(DTYPES[dtype]))


def split_chains(blocks: list[StoredBlock]) -> list[list[StoredBlock]]:
    """Consecutive runs linked by parent hash; a block that does not extend the run starts a new one."""
    chains: list[list[StoredBlock]] = []
    for b in blocks:
        if chains and b.header.parent_hash == chains[-1][-1].header.block_hash:
            chains[-1].append(b)
        else:
            chains.append([b])
    return chains


@dataclass(slots=True)
class RechunkResult:
    blocks: list[StoredBlock]
    dropped_tokens: int  # chain tails shorter than one target block


def rechunk(blocks: list[StoredBlock], block_size: int, keys: HashKeys) -> RechunkResult:
    """Blocks of `block_size` tokens covering the same chains, with recomputed chained hashes."""
    if not blocks:
        return RechunkResult([], 0)
    src = blocks[0].header.block_size
    if block_size == src:
        return RechunkResult(list(blocks), 0)
    if block_size <= 0 or (block_size % src and src % block_size):
        raise IncompatibleKV(f"cannot re-chunk {src} -> {block_size}: not a multiple")
    if blocks[0].header.fingerprint != keys.fingerprint:
        raise IncompatibleKV(f"fingerprint mismatch: blocks {blocks[0].header.fingerprint[:12]}.. "
                             f"vs hash keys {keys.fingerprint[:12]}..")
    out: list[StoredBlock] = []
    dropped = 0
    for chain in split_chains(blocks):
        _check_chain(chain, keys)
        tokens = [t for b in chain for t in b.header.token_ids]
        dim = _token_dim(chain[0].header.layout)
        data = torch.cat([b.data for b in chain], dim=dim)
        usable = len(tokens) // block_size * block_size
        dropped += len(tokens) - usable
        parent: BlockHash | None = None
        for start in range(0, usable, block_size):
            piece = tuple(tokens[start:start + block_size])
            block_hash = hash_block(parent, piece, keys)
            header = replace(chain[0].header, block_hash=block_hash, parent_hash=parent, token_ids=piece,
                             block_size=block_size)
            out.append(StoredBlock(header, data.narrow(dim, start, block_size).contiguous()))
            parent = block_hash
    return RechunkResult(out, dropped)


def _check_chain(chain: list[StoredBlock], keys: HashKeys) -> None:
    first = chain[0].header
    if first.parent_hash is not None:
        raise IncompatibleKV(f"cannot re-chunk a chain that starts mid-prompt (block {first.block_hash.hex()[:12]}.. "
                             "has a parent that is not in the input): export whole prompts")
    parent: BlockHash | None = None
    for b in chain:
        if hash_block(parent, b.header.token_ids, keys) != b.header.block_hash:
            raise IncompatibleKV(f"hash keys do not reproduce block {b.header.block_hash.hex()[:12]}..: "
                                 "wrong tenant salt, adapter or fingerprint")
        parent = BlockHash(b.header.block_hash)
