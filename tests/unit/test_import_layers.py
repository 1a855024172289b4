"""The package never imports a peer; its layers import one way: engine <- algorithms, checkpoint <- frontend <- cli,
accelerate (the mirror of Accelerate's modules: front end and public names only),
and every layer may import the neutral torch-only modules (``fullshard.ranks``), which import no layer."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "fullshard"
FORBIDDEN = ("torch.distributed.fsdp", "torch.distributed._composable", "accelerate", "deepspeed", "fairscale")
# Torch-only modules every layer may import; they import nothing of fullshard.
NEUTRAL = {"ranks"}
# Which top-level subpackages each layer may import from (besides itself and NEUTRAL).
ALLOWED = {
    "engine": set(),
    "algorithms": {"engine"},
    "checkpoint": set(),  # torch only, as the engine (docs/design.md)
    "frontend": {"engine", "algorithms", "checkpoint"},
    "cli": {"frontend", "checkpoint", "algorithms", "engine"},
    # Accelerate's module layout (served as `accelerate`): re-exports of the public surfaces and the front end.
    "accelerate": {
        "frontend",
        "checkpoint",
        "utils",
        "logging",
        "tracking",
        *ast.literal_eval(
            next(
                n.value
                for n in ast.parse((SRC / "__init__.py").read_text()).body
                if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "__all__"
            )
        ),
    },
}


def _imports(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names.extend(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _sources() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def test_sources_found() -> None:
    assert len(_sources()) > 5


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(SRC)))
def test_no_peer_imports(path: Path) -> None:
    bad = [n for n in _imports(path) if any(n == f or n.startswith(f + ".") for f in FORBIDDEN)]
    assert not bad, f"{path} imports a peer: {bad}"


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(SRC)))
def test_layers_import_one_way(path: Path) -> None:
    layer = path.relative_to(SRC).parts[0]
    if layer not in ALLOWED:
        return
    used = {n.split(".")[1] for n in _imports(path) if n.startswith("fullshard.") and len(n.split(".")) > 1}
    wrong = used - ALLOWED[layer] - {layer} - NEUTRAL
    assert not wrong, f"{path} (layer {layer!r}) imports from {sorted(wrong)}"


@pytest.mark.parametrize("name", sorted(NEUTRAL))
def test_neutral_modules_import_no_layer(name: str) -> None:
    used = [n for n in _imports(SRC / f"{name}.py") if n.startswith("fullshard")]
    assert not used, f"fullshard/{name}.py must import torch only, but imports {used}"


def test_checker_catches_a_peer_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("from torch.distributed.fsdp import FullyShardedDataParallel\nimport accelerate\n")
    names = _imports(bad)
    assert any(n.startswith("torch.distributed.fsdp") for n in names)
    assert "accelerate" in names
