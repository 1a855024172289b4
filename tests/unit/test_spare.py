"""SpareStorage moves a freed buffer's memory into the next gather's storage object, or gives it up."""

from __future__ import annotations

import torch

from fullshard.engine.spare import SpareStorage


def _freed_with_view(numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A flat buffer whose storage was freed (as a resharded unit's), and a view of it made before."""
    full = torch.zeros(numel)
    view = full.narrow(0, 2, 3)
    full.untyped_storage().resize_(0)
    return full, view


def test_kept_memory_is_taken_by_a_storage_of_the_same_size_and_seen_through_old_views() -> None:
    spare = SpareStorage()
    donor = torch.arange(8.0)
    pointer = donor.untyped_storage().data_ptr()
    spare.keep(donor.untyped_storage())
    assert donor.untyped_storage().nbytes() == 0 and spare.nbytes == 32

    full, view = _freed_with_view(8)
    assert spare.take(full.untyped_storage(), 32)
    assert full.untyped_storage().data_ptr() == pointer  # the same memory, no new allocation
    assert spare.nbytes == 0
    full.copy_(torch.arange(10.0, 18.0))
    assert torch.equal(view, torch.tensor([12.0, 13.0, 14.0]))  # the view made before the swap sees it


def test_a_gather_of_another_size_drops_the_spare_and_allocates_itself() -> None:
    spare = SpareStorage()
    spare.keep(torch.ones(8).untyped_storage())
    full, _ = _freed_with_view(6)
    assert not spare.take(full.untyped_storage(), 24)
    assert spare.nbytes == 0  # given up, not held on for a size nobody asked for
    assert full.untyped_storage().nbytes() == 0  # left for the caller to allocate


def test_keeping_again_replaces_what_was_held_and_drop_releases_it() -> None:
    spare = SpareStorage()
    spare.keep(torch.ones(8).untyped_storage())
    spare.keep(torch.ones(4).untyped_storage())
    assert spare.nbytes == 16
    spare.drop()
    assert spare.nbytes == 0


def test_meta_and_empty_storages_are_just_freed() -> None:
    spare = SpareStorage()
    meta = torch.empty(8, device="meta")
    spare.keep(meta.untyped_storage())
    assert spare.nbytes == 0
    empty = torch.empty(0)
    spare.keep(empty.untyped_storage())
    assert spare.nbytes == 0
