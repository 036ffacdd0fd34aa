"""Fixtures of the connector's store tests (test_vllm_store.py, test_vllm_advice.py): no vLLM needed."""

from __future__ import annotations

import uuid

import pytest
from kvmesh.config import Settings, TierSettings


@pytest.fixture
def settings(s3_server) -> Settings:
    """A connector store's settings: L2 in shared memory, L3 chunks of two 4-token blocks (the tests' block
    size) on the session's S3 server."""
    return Settings(s3_endpoint=s3_server.endpoint, s3_access_key=s3_server.access_key,
                    s3_secret_key=s3_server.secret_key, s3={"bucket": f"conn-{uuid.uuid4().hex[:10]}"},
                    tiers=TierSettings(l2_shared_memory=True, l2_prefault_bytes=0, l3_chunk_tokens=8,
                                       l3_tail_delay_s=0, l2_capacity_bytes=1 << 24))
