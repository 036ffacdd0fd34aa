"""What a `kvmesh bench serve` stack says it did, from its services' /metrics: evidence that a mode's settings held.

Read after the drive, before the stack stops:
- `prefill_jobs`: jobs each prefill worker handled (round-robin splits them evenly);
- `index_lookups`: cache-index lookups served (the ingress asks only when routing by `cost`; a
  worker asks only with L3 on);
- `hit_tokens`: prompt tokens the prefill workers found cached, by the tier they came from;
- `l1_evicted_blocks`: blocks the engines evicted for room (the sessions outgrew an L1);
- `l2_refused_blocks`: blocks L2 could not take (with 0 bytes: every block offered);
- `l3_upload_workers`: workers with an L3 upload queue (the tier is on there);
- `session_retains`, `session_returns_seen`: the eviction service's session retention at work (chains
  it asked a worker to keep; sessions whose return it had predicted and then saw).
"""

from __future__ import annotations

from pathlib import Path

from kvmesh.bench.serve import stack_metrics_by_service
from kvmesh.protocol import subjects


def stack_evidence(state_dir: Path) -> dict:
    out: dict = {"prefill_jobs": {}, "index_lookups": 0, "hit_tokens": {}, "l1_evicted_blocks": 0,
                 "l2_refused_blocks": 0, "l3_upload_workers": 0, "session_retains": 0, "session_returns_seen": 0}
    uploading: set[str] = set()
    for service, family in stack_metrics_by_service(state_dir):
        if family.name == "kvmesh_l3_upload_chunks":
            uploading.add(service)
        for s in family.samples:
            if s.name == "kvmesh_messages_handled_total" and s.labels.get("subject") == subjects.jobs_prefill(service):
                out["prefill_jobs"][service] = int(s.value)
            elif s.name == "kvmesh_index_lookup_seconds_count":
                out["index_lookups"] += int(s.value)
            elif s.name == "kvmesh_prefix_cache_hits_total":
                tier = s.labels["tier"]
                out["hit_tokens"][tier] = out["hit_tokens"].get(tier, 0) + int(s.value)
            elif s.name == "kvmesh_local_evicted_blocks_total" and s.labels == {"tier": "l1", "reason": "allocation"}:
                out["l1_evicted_blocks"] += int(s.value)
            elif s.name == "kvmesh_local_evicted_blocks_total" and s.labels == {"tier": "l2", "reason": "refused"}:
                out["l2_refused_blocks"] += int(s.value)
            elif s.name == "kvmesh_session_retains_total":
                out["session_retains"] += int(s.value)
            elif s.name == "kvmesh_session_return_prediction_error_seconds_count":
                out["session_returns_seen"] += int(s.value)
    out["prefill_jobs"] = dict(sorted(out["prefill_jobs"].items()))
    out["l3_upload_workers"] = len(uploading)
    return out
