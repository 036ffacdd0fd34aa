"""Copy whole blocks out of and into the paged cache (export / import).

An exported block is ``kv_cache[:, :, block_id]``: ``[num_layers, 2,
block_size, Hkv, D]``; n blocks travel as one contiguous ``[n, ...]`` tensor
(see shared/engine/kv_block.py). On CUDA, `SideStreamCopier` moves them
between the pool and pinned host memory on a stream of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from kvmesh.kernels.dispatch import use_triton


def gather_blocks(
    kv_cache: torch.Tensor,  # [L, 2, num_blocks, block_size, Hkv, D]
    block_ids: torch.Tensor,  # [n] int
) -> torch.Tensor:
    """Return a contiguous copy ``[n, L, 2, block_size, Hkv, D]`` of the blocks."""
    if use_triton(kv_cache):
        from kvmesh.kernels.triton.block_copy import gather_blocks_triton

        return gather_blocks_triton(kv_cache, block_ids)
    ids = block_ids.tolist()
    out = torch.empty((len(ids), kv_cache.shape[0], kv_cache.shape[1], *kv_cache.shape[3:]), dtype=kv_cache.dtype,
                      device=kv_cache.device)
    for i, block_id in enumerate(ids):  # one copy per block (index_select then contiguous would copy twice)
        out[i].copy_(kv_cache[:, :, block_id])
    return out


def scatter_blocks(
    kv_cache: torch.Tensor,  # [L, 2, num_blocks, block_size, Hkv, D]
    block_ids: torch.Tensor,  # [n] int, distinct
    blocks: torch.Tensor | Sequence[torch.Tensor],  # [n, L, 2, block_size, Hkv, D], or n of [L, 2, ...]; any device
) -> None:
    """Write blocks into kv_cache in place at block_ids (dtype/device converted).

    A list of blocks (each a view of the bytes a tier verified) goes into the pool with one copy
    per block on the CPU path; stacking them first would copy every byte twice.
    """
    if use_triton(kv_cache):
        from kvmesh.kernels.triton.block_copy import scatter_blocks_triton

        scatter_blocks_triton(kv_cache, block_ids, blocks if isinstance(blocks, torch.Tensor) else torch.stack(blocks))
        return
    if not isinstance(blocks, torch.Tensor):
        for block_id, block in zip(block_ids.tolist(), blocks, strict=True):
            kv_cache[:, :, block_id].copy_(block)
        return
    ids = block_ids.to(device=kv_cache.device, dtype=torch.long)
    src = blocks.to(device=kv_cache.device, dtype=kv_cache.dtype)
    kv_cache.index_copy_(2, ids, src.permute(1, 2, 0, 3, 4, 5))


@dataclass(slots=True)
class HostCopy:
    """Blocks ``[n, L, 2, block_size, Hkv, D]`` on the host, possibly still arriving.

    `done` is set when the copy came off a CUDA side stream: `wait()` blocks the
    caller (not the engine thread, not the model's stream) until the bytes are there.
    """

    data: torch.Tensor
    done: torch.cuda.Event | None = None

    def wait(self) -> torch.Tensor:
        if self.done is not None:
            self.done.synchronize()
        return self.data


class SideStreamCopier:
    """Pool <-> host copies on a dedicated CUDA stream, so they overlap the model's steps.

    Import: host blocks are staged in pinned memory and copied, then scattered into the
    pool, on the side stream; the compute stream waits on the side stream's event (a
    GPU-side wait: the engine thread does not block) before its next kernels, so a
    step never reads a block that has not landed. Export: the side stream waits for the
    compute stream (the pool's latest writes), gathers the blocks into a device buffer
    and copies that to pinned memory; the compute stream waits only for the gather (its
    next writes may reuse the slots), not for the transfer to the host.
    Pinned buffers come from torch's caching host allocator, which records the copies'
    events, so a buffer is reused only after its copy finished.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def _ids(self, block_ids: torch.Tensor) -> torch.Tensor:
        host = block_ids.to(dtype=torch.long).pin_memory()
        return host.to(self.device, non_blocking=True)  # on the current (side) stream

    def gather_to_host(self, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> HostCopy:
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            staged = gather_blocks(kv_cache, self._ids(block_ids))
            gathered = torch.cuda.Event()
            gathered.record(self.stream)
            host = torch.empty(staged.shape, dtype=staged.dtype, pin_memory=True)
            host.copy_(staged, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        compute.wait_event(gathered)
        return HostCopy(host, done)

    def scatter_from_host(self, kv_cache: torch.Tensor, block_ids: torch.Tensor, blocks: list[torch.Tensor]) -> None:
        """Write host blocks (each ``[L, 2, block_size, Hkv, D]``) into the pool at block_ids."""
        staging = torch.empty((len(blocks), *blocks[0].shape), dtype=blocks[0].dtype, pin_memory=True)
        torch.stack(blocks, out=staging)
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)  # queued steps may still read the slots being overwritten
        with torch.cuda.stream(self.stream):
            on_device = staging.to(self.device, non_blocking=True)
            scatter_blocks(kv_cache, self._ids(block_ids), on_device)
            landed = torch.cuda.Event()
            landed.record(self.stream)
        compute.wait_event(landed)
