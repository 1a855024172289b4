from __future__ import annotations

import pytest
import torch

from fullshard.engine.layout import ShardLayout, group_offsets


@pytest.mark.parametrize("shape", [(5,), (1,), (7, 3), (4, 2), (3, 2, 2), (), (0, 3)])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_layout_matches_torch_chunk(shape: tuple[int, ...], world: int) -> None:
    full = torch.arange(max(1, torch.Size(shape).numel())).reshape(shape) if shape != (0, 3) else torch.empty(0, 3)
    chunks = list(torch.chunk(full.reshape(-1) if not shape else full, world, dim=0)) if full.numel() else []
    gathered = []
    for rank in range(world):
        layout = ShardLayout(shape, world, rank)
        expected = chunks[rank] if rank < len(chunks) else None
        expected_rows = 0 if expected is None else expected.shape[0]
        assert layout.local_rows == expected_rows
        assert layout.local_numel == expected_rows * layout.row_numel
        assert layout.local_numel <= layout.padded_shard_numel
        gathered.append(layout.local_rows)
    assert sum(gathered) == (shape[0] if shape else 1)
    layout0 = ShardLayout(shape, world, 0)
    assert world * layout0.rows_per_rank >= layout0.dim0  # the gathered padded rows cover the parameter


def test_layout_rejects_bad_rank() -> None:
    with pytest.raises(ValueError, match=r"ShardLayout\(world=2, rank=2\)"):
        ShardLayout((4,), 2, 2)


def test_group_offsets() -> None:
    assert group_offsets([3, 0, 5]) == [0, 3, 3]


@pytest.mark.parametrize("shape", [(5,), (1,), (7, 3), (3, 2, 2), ()])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_rows_of_and_full_of_invert_each_other(shape: tuple[int, ...], world: int) -> None:
    """Each rank's rows are torch.chunk's piece; padded shards gathered in rank order rebuild the tensor."""
    from fullshard.engine.param import ShardedParam

    full = torch.arange(float(max(1, torch.Size(shape).numel()))).reshape(shape)
    chunks = torch.chunk(full.reshape(1) if not shape else full, world, dim=0)
    sp = ShardedParam("w", [], ShardLayout(shape, world, 0), full.dtype, True, offset=2)
    padded = sp.layout.padded_shard_numel
    by_rank = torch.full((world, 2 + padded + 1), -1.0)  # other parameters' elements around this one
    for rank in range(world):
        rows = sp.rows_of(full, rank)
        expected = chunks[rank] if rank < len(chunks) else full.reshape(-1, *shape[1:])[:0]
        assert torch.equal(rows, expected.reshape(rows.shape))
        by_rank[rank, 2 : 2 + rows.numel()] = rows.reshape(-1)
    assert torch.equal(sp.full_of(by_rank, world), full)
    assert torch.equal(sp.rows_of(full), sp.rows_of(full, 0))
