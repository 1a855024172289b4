"""The environment of a launched ``fullshard`` job (test_cli.py keeps its own, with OMP_NUM_THREADS=1)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.fixture
def child_env(tmp_path: Path) -> dict[str, str]:
    """This worktree's code, a private config home, and no OMP_NUM_THREADS (the launcher sets it quietly)."""
    variables = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_", "ACCELERATE_", "FULLSHARD_"))}
    variables.pop("OMP_NUM_THREADS", None)
    variables.update(PYTHONPATH=str(SRC), FULLSHARD_HOME=str(tmp_path / "home"))
    return variables
