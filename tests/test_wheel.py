"""kvmesh installs as one import name: a wheel holds only `kvmesh`, and its package list matches the tree."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _setuptools_table() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_folder_with_an_init_is_a_listed_package() -> None:
    table = _setuptools_table()
    on_disk = set()
    for name, folder in table["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            on_disk.add(".".join([name, *rel]))
    assert set(table["packages"]) == on_disk


def test_a_wheel_holds_only_kvmesh(tmp_path: Path) -> None:
    # As `pip install .` builds it: in an isolated env with the setuptools pyproject.toml asks for.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(ROOT)],
                   check=True, timeout=600)
    (wheel,) = tmp_path.glob("kvmesh-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith((".dist-info", ".data"))}
    assert top == {"kvmesh"}
    for module in ("kvmesh/cli/main.py", "kvmesh/services/prefill/__main__.py", "kvmesh/kernels/dispatch.py",
                   "kvmesh/bench/peer_fetch.py", "kvmesh/chaos/stack.py", "kvmesh/report/prices.yaml"):
        assert module in names
    entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "kvmesh = kvmesh.cli.main:app" in zipfile.ZipFile(wheel).read(entry).decode()
