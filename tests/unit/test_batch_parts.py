"""A batch's parts name the runs of consecutive slots their sequences hold, in order: the
layers read and write those states as slices of a cache."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from transfer.model.batch import SequenceStep, make_batch


@given(st.lists(st.integers(0, 40), min_size=1, max_size=24, unique=True), st.data())
def test_slot_runs_cover_the_slots_in_order_and_are_maximal(slots, data):
    decodes = data.draw(st.lists(st.booleans(), min_size=len(slots), max_size=len(slots)))
    sequences = [
        SequenceStep.decode(1, slot, [0], 1) if decode else SequenceStep([1, 2], slot, [0])
        for slot, decode in zip(slots, decodes, strict=True)
    ]
    batch = make_batch(sequences, None)
    for part, chunked in ((batch.prefill, True), (batch.decode, False)):
        member_slots = [s.slot for s in sequences if s.prefill == chunked]
        if part is None:
            assert not member_slots
            continue
        covered = []
        for row, slot, count in part.slot_runs:
            assert row == len(covered) and count >= 1
            covered += range(slot, slot + count)
        assert covered == member_slots
        for (_, slot, count), (_, next_slot, _) in zip(
            part.slot_runs, part.slot_runs[1:], strict=False
        ):
            assert slot + count != next_slot, "two runs that make one"
