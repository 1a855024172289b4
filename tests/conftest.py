"""Shared fixtures: gloo worker pools spawned once per session and reused by every distributed test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fullshard.testing import WorkerPool


@pytest.fixture(scope="session")
def pool2() -> Iterator[WorkerPool]:
    pool = WorkerPool(2)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def pool4() -> Iterator[WorkerPool]:
    pool = WorkerPool(4)
    yield pool
    pool.close()
