"""vLLM's CPU paged KV, block by block, to and from kvmesh's NHD block layout.

vLLM's CPU attention keeps one tensor per layer, `[num_blocks, kv_heads,
block_size, 2 * head_dim]` (its "LBHNC" layout). The last two dims are not
what they look like: each (block, head) page of `block_size * 2 * head_dim`
values is the K region then the V region, each packed in the order the
attention kernel for the CPU's instruction set wants. For the "vec" kernel
(x86 without AMX, head_dim a multiple of 32) K is stored transposed,
`[head_dim, block_size]`, and V row-major, `[block_size, head_dim]`;
tests/connectors check this against kvmesh's own engine on the same
checkpoint. Other kernels (vec16, AMX tiles, Arm, PowerPC) have not been
checked and are refused: copying their pages as if they were "vec" would
hand wrong KV to the next reader.

kvmesh stores a block as `[layers, 2, block_size, kv_heads, head_dim]` (NHD,
shared/engine/kv_block.py), so what vLLM computed is readable by every kvmesh
tool (`kvmesh kv inspect/convert`) and by a reader on another instruction set.
"""

from __future__ import annotations

import torch
from kvmesh.kvconvert.errors import IncompatibleKV

PACKINGS = ("vec",)  # vLLM CPU attention kernels whose page packing this module knows (and a test checks)


def check_packing(isa: str) -> None:
    if isa not in PACKINGS:
        raise IncompatibleKV(f"vLLM's CPU KV packing for the {isa!r} kernel is not known to kvmesh "
                             f"(known: {', '.join(PACKINGS)}): its pages cannot be converted")


def pages_to_blocks(pages: list[torch.Tensor]) -> torch.Tensor:
    """Per-layer pages `[n, H, N, 2D]` (n blocks) -> kvmesh blocks `[n, L, 2, N, H, D]` (a new tensor)."""
    n, heads, size, width = pages[0].shape
    dim = width // 2
    out = torch.empty((n, len(pages), 2, size, heads, dim), dtype=pages[0].dtype)
    for layer, page in enumerate(pages):
        flat = page.reshape(n, heads, 2, size * dim)
        out[:, layer, 0] = flat[:, :, 0].reshape(n, heads, dim, size).permute(0, 3, 1, 2)  # K: [D, N] per head
        out[:, layer, 1] = flat[:, :, 1].reshape(n, heads, size, dim).permute(0, 2, 1, 3)  # V: [N, D] per head
    return out


def blocks_to_pages(blocks: torch.Tensor) -> list[torch.Tensor]:
    """kvmesh blocks `[n, L, 2, N, H, D]` -> per-layer pages `[n, H, N, 2D]` in vLLM's "vec" packing."""
    n, layers, _, size, heads, dim = blocks.shape
    pages = []
    for layer in range(layers):
        page = torch.empty((n, heads, 2, dim * size), dtype=blocks.dtype)
        page[:, :, 0] = blocks[:, layer, 0].permute(0, 2, 3, 1).reshape(n, heads, dim * size)
        page[:, :, 1] = blocks[:, layer, 1].permute(0, 2, 1, 3).reshape(n, heads, size * dim)
        pages.append(page.view(n, heads, size, 2 * dim))
    return pages
