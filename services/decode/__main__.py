"""The decode service: `python -m kvmesh.services.decode` (logic in shared/serving; with
`KVMESH_ENGINE__BACKEND=vllm`, vLLM's engine: shared/connectors/vllm/serving.py)."""

from kvmesh.config import load_settings
from kvmesh.protocol.messages import Role
from kvmesh.service.runner import run_service
from kvmesh.serving.services import setup_decode

settings = load_settings()
if settings.engine.backend == "vllm":
    from kvmesh.connectors.vllm.serving import setup_vllm_decode as setup
else:
    setup = setup_decode
raise SystemExit(run_service("decode", Role.DECODE, setup, settings))
