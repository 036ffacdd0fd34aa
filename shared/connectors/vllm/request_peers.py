"""The same-host workers a request names as holding its prefix, in vLLM's `kv_transfer_params`.

A vLLM request may carry `{"kvmesh_peers": [worker id, ...]}` in its
`kv_transfer_params`: a vLLM prefill worker handing a request to a vLLM decode
worker names itself there (shared/workers/vllm_backend.py), so the decode
worker's connector reads the prompt's blocks out of that worker's L2 slab,
after its own L2 and its configured peers, before S3. Naming a worker grants
nothing: a block is found by its tenant-salted hash, so a request can only
load blocks of its own tenant's chain, wherever they are.
"""

from __future__ import annotations

PEERS_PARAM = "kvmesh_peers"
MAX_REQUEST_PEERS = 8


def request_peers(kv_transfer_params: object) -> tuple[str, ...]:
    """The worker ids a request names under `PEERS_PARAM`, at most `MAX_REQUEST_PEERS` (anything else is ignored)."""
    named = kv_transfer_params.get(PEERS_PARAM) if isinstance(kv_transfer_params, dict) else None
    if not isinstance(named, list):
        return ()
    return tuple(dict.fromkeys(p for p in named if isinstance(p, str) and p))[:MAX_REQUEST_PEERS]
