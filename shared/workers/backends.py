"""`setup_for`: the setup of a prefill or decode service for the configured engine backend."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from kvmesh.config import Settings
from kvmesh.protocol.messages import Role
from kvmesh.service.runner import ServiceContext

Setup = Callable[[ServiceContext], Awaitable[None]]


def setup_for(role: Role, settings: Settings) -> Setup:
    """vLLM's worker (imported only when it runs: vLLM loads for seconds) or kvmesh's own, by engine.backend."""
    if settings.engine.resolved_backend() == "vllm":
        from kvmesh.workers import vllm_backend

        return vllm_backend.setup_vllm_prefill if role == Role.PREFILL else vllm_backend.setup_vllm_decode
    from kvmesh.serving import services

    return services.setup_prefill if role == Role.PREFILL else services.setup_decode
