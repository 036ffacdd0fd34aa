"""Runs the Triton checks in fresh processes: interpreter cases, then a GPU compile.

triton_cases.py needs TRITON_INTERPRET=1 before triton is first imported,
which in-process would come too late whenever anything imported triton
before (torch does, lazily); gpu_compile.py needs it off. Each gets a process
of its own; its full output is shown when it fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CASES = Path(__file__).with_name("triton_cases.py")
COMPILE = Path(__file__).with_name("gpu_compile.py")


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


def test_triton_kernels_compile_for_cuda(tmp_path: Path) -> None:
    """Every kernel goes through Triton's GPU pipeline to a cubin (no GPU needed)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    result = subprocess.run(
        [sys.executable, str(COMPILE)], cwd=COMPILE.parents[2], env=env, capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert result.stdout.count("compiled ") == 8, result.stdout
