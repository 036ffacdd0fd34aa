"""Load compose.yaml as `docker compose` does: interpolate `${...}` from an environment, then validate.

compose-spec validates the interpolated file (a `${KVMESH_BIND:-127.0.0.1}`
host ip is only an address after that step), so tests interpolate first.
"""

from __future__ import annotations

import re
from pathlib import Path

import compose_spec

ROOT = Path(__file__).resolve().parents[2]

# What a user exports before `docker compose up` (compose.yaml's header).
USER_ENV = {"KVMESH_API_KEYS": "sk-dev:dev", "KVMESH_S3_SECRET_KEY": "minio-root-password"}
VAR = re.compile(r"(?<!\$)\$\{(\w+)(?::([-?])([^}]*))?\}")


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's `${VAR}`, `${VAR:-default}`, `${VAR:?error}` step (run before it validates); `$$` is left alone."""
    def one(m: re.Match) -> str:
        var, op, arg = m.groups()
        if env.get(var):
            return env[var]
        if op == "?":
            raise ValueError(f"required variable {var} is missing: {arg}")
        return arg if op == "-" else ""
    return VAR.sub(one, text)


def load(env: dict[str, str]) -> dict:
    parsed = compose_spec.PyCompose.from_yaml(interpolate((ROOT / "compose.yaml").read_text(), env))
    parsed.validate()
    return parsed.to_dict()
