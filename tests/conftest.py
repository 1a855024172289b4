"""Shared fixtures: gloo worker pools spawned once per session and reused by every distributed test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fullshard.testing import WorkerPool

_SESSION_POOLS: list[WorkerPool] = []


def _session_pool(world_size: int) -> Iterator[WorkerPool]:
    pool = WorkerPool(world_size)
    _SESSION_POOLS.append(pool)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def pool1() -> Iterator[WorkerPool]:
    yield from _session_pool(1)


@pytest.fixture(scope="session")
def pool2() -> Iterator[WorkerPool]:
    yield from _session_pool(2)


@pytest.fixture(scope="session")
def pool4() -> Iterator[WorkerPool]:
    yield from _session_pool(4)


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the session's pools when the run leaves an area (a pool starts again when a test uses it).

    The ranks keep the process groups the tests made (meshes, subgroups: gloo's threads with them): after the
    distributed tests each rank of the 4-rank pool held 254 threads and used 0.08 s of CPU a second while idle,
    which slowed every later area on this 2-core machine (the Trainer's tests 138 s alone, 248 s after them)."""
    if nextitem is None or _area(nextitem.nodeid) != _area(item.nodeid):
        for pool in _SESSION_POOLS:
            pool.close()


_AREAS = {
    "unit": "single-process units",
    "distributed": "engine and front end on gloo ranks",
    "cli": "the fullshard command, examples, launch faults",
    "compat": "against the peers (torch FSDP, Accelerate, DCP)",
    "dropin": "Accelerate's example scripts by import swap",
    "trainer": "transformers' Trainer with FSDP under --as_accelerate",
    "gpu": "CUDA (skipped without a GPU)",
}


_SECONDS: dict[str, float] = {}


def _area(nodeid: str) -> str:
    parts = nodeid.split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else "other"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Time per area, fixtures' setup and teardown included (a spawned launch often runs in a fixture)."""
    _SECONDS[_area(report.nodeid)] = _SECONDS.get(_area(report.nodeid), 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Per-area counts and time, so that a person reading the end of a run sees where it went."""
    rows: dict[str, dict[str, int]] = {}
    for outcome, column in (("passed", "passed"), ("failed", "failed"), ("error", "failed"), ("skipped", "skipped")):
        for report in terminalreporter.stats.get(outcome, []):
            if not hasattr(report, "nodeid"):
                continue
            row = rows.setdefault(_area(report.nodeid), {"passed": 0, "failed": 0, "skipped": 0})
            row[column] += 1
    if not rows:
        return
    terminalreporter.section("tests by area")
    for area, row in sorted(rows.items(), key=lambda item: -_SECONDS.get(item[0], 0.0)):
        terminalreporter.write_line(
            f"{area:<12} {row['passed']:4d} passed {row['failed']:3d} failed {row['skipped']:3d} skipped "
            f"{_SECONDS.get(area, 0.0):7.1f} s   {_AREAS.get(area, '')}"
        )
