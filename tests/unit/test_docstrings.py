"""A module docstring of src/ says what the module does and which public behaviour it mirrors, not the project's
history: no seed ("seed 001", "seeds 001, 002") and no issue ("issue 27 §1") is cited."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "fullshard"
HISTORY = re.compile(r"\b(?:seeds?|issues?)\s+#?\d+|§\s*\d+", re.IGNORECASE)


def _module_docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text(), filename=str(path)), clean=False) or ""


def _citations(text: str) -> list[str]:
    return [m.group(0) for m in HISTORY.finditer(text)]


@pytest.mark.parametrize("path", sorted(SRC.rglob("*.py")), ids=lambda p: str(p.relative_to(SRC)))
def test_module_docstring_cites_no_seed_or_issue(path: Path) -> None:
    found = _citations(_module_docstring(path))
    assert not found, f"{path}: its docstring cites {found}; say what the module does and which behaviour it mirrors"


def test_the_scan_finds_citations() -> None:
    assert _citations("Names as Accelerate lays them out (seeds 001, 002); see issue 27 §1.") == [
        "seeds 001",
        "issue 27",
        "§1",
    ]
    assert _citations("The weights after every step are bitwise the same for a fixed seed.") == []
