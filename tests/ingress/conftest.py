"""Fixtures of the ingress tests: the tiny synthetic checkpoint the serving stacks load."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.engine.presets import write_preset


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_preset(tmp_path_factory.mktemp("tiny-llama"), "tiny", "llama", seed=0)
