"""RequestSlots: a row per request in one array, zeros for a request without one, rows reused once given back."""
import numpy as np
import pytest

from smartspec.policy.request_slots import RequestSlots


def test_rows_are_taken_read_given_back_and_reused_and_the_table_grows():
    slots = RequestSlots(2, capacity=2)
    rows = slots.rows_for(["a", "b"])
    slots.values[rows] = [[1.0, 2.0], [3.0, 4.0]]
    assert slots.values[slots.rows_of(["b", "x", "a"])].tolist() == [[3.0, 4.0], [0.0, 0.0], [1.0, 2.0]]
    more = slots.rows_for(["a", "c", "d"])  # two new past the capacity: the table grows, a keeps its row
    assert more[0] == rows[0] and len(set(more.tolist()) | set(rows.tolist())) == 4 and len(slots) == 4
    slots.values[more[1:]] = 7.0
    assert slots.pop("b").tolist() == [3.0, 4.0] and slots.pop("b") is None and "b" not in slots
    assert slots.values[slots.rows_of(["b", "c"])].tolist() == [[0.0, 0.0], [7.0, 7.0]]
    (reused,) = slots.rows_for(["e"])
    assert reused == rows[1] and slots.values[reused].tolist() == [0.0, 0.0]  # b's row, zeros again
    assert slots.values[0].tolist() == [0.0, 0.0]


def test_sizes_are_checked():
    with pytest.raises(ValueError, match="columns"):
        RequestSlots(0)
    with pytest.raises(ValueError, match="capacity"):
        RequestSlots(2, capacity=np.int64(0))
