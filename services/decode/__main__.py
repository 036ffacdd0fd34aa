"""The decode service: `python -m services.decode` (logic in shared/serving)."""

from shared.protocol.messages import Role
from shared.service.runner import run_service
from shared.serving.services import setup_decode

raise SystemExit(run_service("decode", Role.DECODE, setup_decode))
