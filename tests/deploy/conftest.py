from __future__ import annotations

from collections.abc import Iterator

import helm_python
import pytest

from .chart import CHART_DIR


@pytest.fixture(scope="session")
def chart() -> Iterator[helm_python.Chart]:
    with helm_python.Chart.load(CHART_DIR) as loaded:
        yield loaded
