"""Session-scoped tiny synthetic checkpoints, written to tmp dirs once per run.

`tiny_model_dir`: Llama, Llama-3.1 rope scaling, untied lm_head, fp32.
`tiny_qwen2_model_dir`: Qwen2, q/k/v bias, tied embeddings, fp32.
Tests must not modify these dirs (copy first).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.engine.presets import write_preset


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_preset(tmp_path_factory.mktemp("tiny-llama"), "tiny", "llama", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen2_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_preset(tmp_path_factory.mktemp("tiny-qwen2"), "tiny", "qwen2", seed=0)
