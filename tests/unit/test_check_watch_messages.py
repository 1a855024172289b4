"""The check's tags and the watch's messages, without ranks (``engine/collective_check.py``, ``check_watch.py``)."""

from __future__ import annotations

import pytest

from fullshard.engine import check_watch, collective_check, p2p


def test_payload_tags_differ_by_count_kind_and_unit_and_stay_clear_of_the_other_tags() -> None:
    tags = {
        collective_check.payload_tag(kind, unit, count)
        for kind in ("all_gather", "reduce_scatter")
        for unit in ("", "layers.0", "layers.1")
        for count in range(1, 2001)
    }
    assert len(tags) == 2 * 3 * 2000  # one tag per collective: a payload meets only the same collective
    others = {collective_check.HEADER_TAG, check_watch.DIAG_TAG, p2p.ALL_GATHER_TAG, p2p.REDUCE_SCATTER_TAG}
    assert not tags & others
    # Below gloo's collective slots (their prefix takes the top byte of the 64-bit slot; point-to-point tags are
    # 32-bit) and above the small tags a script may use.
    assert all(0x40000000 <= tag < 0x80000000 for tag in tags)
    assert collective_check.payload_tag("all_gather", "a", 7) == collective_check.payload_tag("all_gather", "a", 7)


def test_a_query_carries_records_and_the_waited_messages() -> None:
    records = [(0, 11, 5, 2), (3, 12, 6, 2)]
    message = check_watch._message(check_watch._QUERY, records, [1, 0x40000123, 2, 4096, 64])
    assert len(message) == check_watch._MESSAGE_LEN  # a fixed size: gloo's receive needs one
    kind, parsed, tail = check_watch._parse(message.tolist())
    assert kind == check_watch._QUERY and parsed == records
    assert tail[:5] == [1, 0x40000123, 2, 4096, 64]  # sender, tag, sizes to mirror


def test_the_out_of_step_message_names_what_each_known_rank_runs() -> None:
    a = (0, 1, 9, 3)  # all_gather, unit with CRC 1, collective #9, forward #3
    b = (1, 2, 9, 2)
    collective_check._label_of_crc.update({1: "layers.0", 2: "layers.1"})
    error = collective_check._out_of_step({0: a, 3: b}, ranks=[0, 1, 2, 3], me=0)
    text = str(error)
    assert "ranks are out of step: this rank is about to run all_gather of unit 'layers.0' (collective #9" in text
    assert ", rank 3 reduce_scatter of unit 'layers.1' (collective #9 of its group) in its forward #2." in text
    assert "rank 1: not known here" in text and "rank 2: not known here" in text


def test_blocking_headers_at_other_counts_are_out_of_step() -> None:
    # Headers pair first-in first-out on one tag: the same collective at another place in the group's sequence
    # would pass a comparison of kind and unit alone, and shift every later payload's tag.
    collective_check._label_of_crc[5] = "clip_grad_norm_"
    mine, theirs = [5, 5, 12, 4], [5, 5, 13, 4]  # all_reduce compared before it is posted, #12 against #13
    collective_check._raise_if_out_of_step([mine, mine], ranks=[0, 1], me=0)  # equal: nothing raised
    with pytest.raises(collective_check.DesyncError, match=r"rank 1 all_reduce .*\(collective #13 of its group\)"):
        collective_check._raise_if_out_of_step([mine, theirs], ranks=[0, 1], me=0)
