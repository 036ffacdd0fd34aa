"""The prefill service: `python -m services.prefill` (logic in shared/serving)."""

from shared.protocol.messages import Role
from shared.service.runner import run_service
from shared.serving.services import setup_prefill

raise SystemExit(run_service("prefill", Role.PREFILL, setup_prefill))
