import pytest

from smartspec.engine.block_manager import BlockManager
from smartspec.engine.request import Request, RequestStatus
from smartspec.engine.scheduler import Scheduler
from smartspec.sampling_params import SamplingParams


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


def test_scheduler_respects_token_budget_and_chunks_prefill():
    bm = BlockManager(100, 4)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=10)
    for rid, n in (("a", 7), ("b", 7), ("c", 3)):
        s.add(req(rid, n))
    batch = s.schedule()
    assert [(x.request.request_id, x.num_tokens) for x in batch] == [("a", 7), ("b", 3)]
    assert sum(x.num_tokens for x in batch) <= 10
    for x in batch:
        x.request.num_computed_tokens += x.num_tokens
    batch = s.schedule()  # b's prefill continues in chunks, c is admitted with the budget left
    assert [(x.request.request_id, x.num_tokens) for x in batch] == [("b", 4), ("c", 3)]


def test_scheduler_respects_max_num_seqs():
    s = Scheduler(BlockManager(100, 4), max_num_seqs=2, max_num_batched_tokens=100)
    for rid in "abc":
        s.add(req(rid, 2))
    assert [x.request.request_id for x in s.schedule()] == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["c"]


def test_preemption_recomputes_youngest_and_never_drops():
    bm = BlockManager(4, 4)  # 16 token slots
    s = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = req("a", 8), req("b", 8)
    s.add(a)
    s.add(b)
    for x in s.schedule():
        x.request.num_computed_tokens += x.num_tokens
    assert bm.num_free == 0
    a.token_ids.append(1)  # a needs a 9th slot: a fifth block
    batch = s.schedule()
    assert [x.request.request_id for x in batch] == ["a"]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert list(s.waiting) == [b]  # at the front, to be recomputed
    s.remove(a)
    assert bm.num_free == 4
    assert [x.request.request_id for x in s.schedule()] == ["b"]
