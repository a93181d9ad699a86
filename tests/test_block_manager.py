import pytest

from smartspec.runtime.block_manager import BlockManager
from smartspec.types.request import Request
from smartspec.types.sampling_params import SamplingParams


def req(rid, n):
    return Request(rid, list(range(n)), SamplingParams())


def test_allocate_truncate_free_no_leak():
    bm = BlockManager(10, 4)
    a, b = req("a", 9), req("b", 4)
    bm.allocate(a, 9)
    assert len(a.block_table) == 3 and bm.num_free == 7
    bm.allocate(b, 4)
    assert len(b.block_table) == 1
    assert len(set(a.block_table) | set(b.block_table)) == 4  # no block given twice
    a.num_computed_tokens = 9
    bm.truncate(a, 5)  # drop the last 4 tokens: one whole block back
    assert len(a.block_table) == 2 and a.num_computed_tokens == 5 and bm.num_free == 7
    assert bm.slot(a, 4) == a.block_table[1] * 4
    with pytest.raises(RuntimeError, match="KV blocks needed"):
        bm.allocate(b, 4 * 9)
    bm.free(a)
    bm.free(b)
    assert bm.num_free == 10 and sorted(bm._free) == list(range(10))
