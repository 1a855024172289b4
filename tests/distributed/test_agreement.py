"""fullshard.ranks: every rank raises the same error, naming the rank that failed or disagrees, and its value."""

from __future__ import annotations

import pytest

from fullshard.ranks import RanksDisagreeError, first_difference, require_agreement
from fullshard.testing import WorkerPool


def _agree(rank: int, world: int, case: str) -> tuple[str, str]:
    value = [1, 2, 3] if case != "differ" or rank == 0 else [1, 2, 3 + rank]
    problem = f"cannot initialise 'head' (rank {rank})" if case == "problem" and rank == world - 1 else None
    try:
        everyone = require_agreement(value, what="the check", remedy="Do the same on every rank", problem=problem)
    except ValueError as exc:  # RanksDisagreeError is a ValueError (and a RuntimeError)
        return type(exc).__name__, str(exc)
    return "ok", repr(everyone)


def test_agreement_returns_every_value(pool2: WorkerPool) -> None:
    assert pool2.run(_agree, "same") == [("ok", "[[1, 2, 3], [1, 2, 3]]")] * 2


def test_disagreement_raises_on_every_rank_naming_rank_and_values(pool2: WorkerPool) -> None:
    for kind, message in pool2.run(_agree, "differ"):
        assert kind == "RanksDisagreeError"
        assert message == "the check: rank 1 has [1, 2, 4], but rank 0 has [1, 2, 3]. Do the same on every rank."
    assert issubclass(RanksDisagreeError, RuntimeError)


def test_a_problem_on_one_rank_raises_on_every_rank(pool2: WorkerPool) -> None:
    for kind, message in pool2.run(_agree, "problem"):
        assert (kind, message) == ("ValueError", "the check: on rank 1, cannot initialise 'head' (rank 1)")


def test_without_a_process_group_only_problems_raise() -> None:
    assert require_agreement("x", what="w", remedy="r") == ["x"]
    with pytest.raises(ValueError, match=r"^w: on rank 0, broken$"):
        require_agreement("x", what="w", remedy="r", problem="broken")


def test_first_difference() -> None:
    assert first_difference([1, 2, 3], [1, 5, 3]) == (1, 2, 5)
    assert first_difference([1, 2], [1, 2, 3], "nothing") == (2, "nothing", 3)
