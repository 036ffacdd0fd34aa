"""Runs triton_cases.py in a fresh process with the Triton interpreter on.

In-process the variable would come too late whenever anything imported
triton before (torch does, lazily), so the cases get a process of their own;
their full pytest report is shown when one fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CASES = Path(__file__).with_name("triton_cases.py")


def test_triton_kernels_in_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("KVMESH_KERNELS", None)  # the cases choose the path per call
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", str(CASES)],
        cwd=CASES.parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]
