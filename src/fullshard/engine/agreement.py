"""Checks that every rank built the same units and runs them in one order, raised on every rank, naming the first
rank and unit that differ from rank 0 (instead of a hang or a size mismatch later).

``UnitState`` (``unit_state.py``) calls them: the units' signatures at the root's lazy init, and in debug mode the
order units ran forward in, after each root forward. The units are typed ``Any`` here: ``unit_state`` imports this
module; of a unit it reads ``signature()``.
"""

from __future__ import annotations

from typing import Any

from fullshard.ranks import first_difference, require_agreement

__all__ = ["check_same_order_on_all_ranks", "check_same_units_on_all_ranks"]


def check_same_order_on_all_ranks(order: list[str]) -> None:
    """Raise on every rank, naming the first unit that ran in another place than on rank 0 this iteration."""

    def describe(rank: int, theirs: list[str], ours: list[str]) -> str:
        i, mine, other = first_difference(ours, theirs, "nothing")
        return f"unit #{i} was {mine!r} on rank 0 and {other!r} on rank {rank}"

    require_agreement(
        order,
        what="ranks ran units in different orders this iteration",
        describe=describe,
        remedy="Every rank must run the same units in the same order",
    )


def check_same_units_on_all_ranks(states: list[Any]) -> None:
    """Raise on every rank, naming the first rank and unit that differ from rank 0 (no hang later)."""
    require_agreement(
        [s.signature() for s in states],
        what="the sharded model differs across ranks",
        describe=_describe_difference,
        remedy="Every rank must build the same model (same config and sizes) and wrap it with the same policy "
        "before training",
    )


def _describe_difference(rank: int, theirs: list[Any], reference: list[Any]) -> str:
    def text(sig: Any) -> str:
        if sig is None:
            return "no unit"
        label, params = sig
        shown = ", ".join(f"{n} {tuple(s)} {d}" for n, s, d in params[:6])
        more = f", ... ({len(params)} in all)" if len(params) > 6 else ""
        return f"unit {label!r} with parameters [{shown}{more}]"

    _, ours, other = first_difference(reference, theirs, None)
    where = (other or ours)[0]
    return f"at module {where!r}, rank {rank} has {text(other)}, but rank 0 has {text(ours)}"
