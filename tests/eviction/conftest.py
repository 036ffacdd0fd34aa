"""Fixtures of the eviction tests (helpers live in helpers.py)."""

from __future__ import annotations

import pytest

from shared.engine.loader import LoadedModel, load_model
from shared.engine.presets import write_preset


@pytest.fixture(scope="session")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """The tiny synthetic checkpoint, loaded once."""
    return load_model(write_preset(tmp_path_factory.mktemp("evict-tiny"), "tiny", "llama", seed=0))
