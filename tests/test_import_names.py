"""No source file names kvmesh's folders by their old top-level import names.

Run from the repository root, `import shared` or `python -m services.prefill` still works (the root is on
sys.path), so a stale name would pass every other test and break only once installed. Checked on the
syntax tree: import statements, the module after "-m" in an argv list, and `-m` / `-c` code in strings.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OLD = ("shared", "services", "kernels", "bench", "chaos")
FOLDERS = (*OLD, "tests", "deploy")
IN_TEXT = re.compile(rf"(?:-m |from |import )((?:{'|'.join(OLD)})\.[\w.]*)")


def _is_old(module: str) -> bool:
    return module.split(".")[0] in OLD


def _leading_text(node: ast.expr) -> str | None:
    """A string constant, or an f-string's literal start ('services.' of f"services.{role}")."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        return str(node.values[0].value)
    return None


def _stale(path: Path) -> list[str]:
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.lineno, node.module)] if _is_old(node.module) else []
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if _is_old(a.name)]
        elif isinstance(node, ast.List | ast.Tuple):
            for flag, arg in zip(node.elts, node.elts[1:]):
                text = _leading_text(arg)
                if _leading_text(flag) == "-m" and text and _is_old(text):
                    found.append((arg.lineno, text))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found += [(node.lineno, m[1]) for m in IN_TEXT.finditer(node.value)]
    return [f"{path.relative_to(ROOT)}:{line}: {name}" for line, name in found]


def test_no_source_uses_an_old_top_level_name() -> None:
    sources = [p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts and p != Path(__file__).resolve()]
    assert [hit for path in sources for hit in _stale(path)] == []
