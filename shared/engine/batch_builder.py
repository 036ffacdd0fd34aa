"""Turn one step's scheduled sequences into a `ForwardBatch`.

Hot path: decodes (one token each) are plain integer arithmetic; prefill
chunks use one arange per sequence; every tensor is built once from a
Python list.
"""

from __future__ import annotations

import torch
from kvmesh.engine.forward_batch import ForwardBatch
from kvmesh.engine.scheduler import ScheduledSeq


def build_forward_batch(scheduled: list[ScheduledSeq], block_size: int, device: str = "cpu") -> ForwardBatch:
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_lens: list[int] = []
    context_lens: list[int] = []
    tables: list[list[int]] = []
    for s in scheduled:
        req = s.request
        start, n = req.num_computed, s.num_new
        table = [b.block_id for b in req.blocks]
        if n == 1:
            input_ids.append(req.token_ids[start])
            positions.append(start)
            slots.append(table[start // block_size] * block_size + start % block_size)
        else:
            input_ids.extend(req.token_ids[start : start + n])
            pos = range(start, start + n)
            positions.extend(pos)
            slots.extend(table[p // block_size] * block_size + p % block_size for p in pos)
        query_lens.append(n)
        context_lens.append(start + n)
        tables.append(table)
    width = max(len(t) for t in tables)
    padded = [t + [0] * (width - len(t)) for t in tables]
    qlens = torch.tensor(query_lens, dtype=torch.int32)
    return ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        query_lens=qlens.to(device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        logits_indices=(torch.cumsum(qlens, 0, dtype=torch.int64) - 1).to(device),
    )
