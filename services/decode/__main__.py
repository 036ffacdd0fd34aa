"""The decode service: `python -m kvmesh.services.decode`; its engine backend is picked by
shared/workers/backends.py (vLLM: shared/workers/vllm_backend.py; native: shared/serving)."""

from kvmesh.config import load_settings
from kvmesh.protocol.messages import Role
from kvmesh.service.runner import run_service
from kvmesh.workers.backends import setup_for

settings = load_settings()
raise SystemExit(run_service("decode", Role.DECODE, setup_for(Role.DECODE, settings), settings))
