"""Check that deployment env vars name real kvmesh settings (a typo would be silently ignored)."""

from __future__ import annotations

import pytest
from kvmesh.config import Settings


def assert_settings_apply(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    """Every KVMESH_* key maps to a Settings field (nested with `__`); then set them all in the environment."""
    defaults = Settings()
    for key, value in env.items():
        top, _, nested = key.removeprefix("KVMESH_").lower().partition("__")
        assert key.startswith("KVMESH_") and top in Settings.model_fields, key
        if nested:
            assert nested in type(getattr(defaults, top)).model_fields, key
        monkeypatch.setenv(key, str(value))
