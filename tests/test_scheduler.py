"""The scheduler: which requests run in a step and how many of their tokens (continuous batching, chunked
prefill, preemption by recompute), and how a batch splits into decoding requests and prefill chunks."""
import pytest

from smartspec.engine.scheduler import ScheduledRequest, Scheduler, split_batch
from smartspec.runtime.block_manager import BlockManager
from smartspec.types.request import Request, RequestStatus
from smartspec.types.sampling_params import SamplingParams


def req(rid, n):
    return Request(rid, list(range(n)), SamplingParams())


def run(batch):
    """What the engine does after a step: every scheduled token is computed."""
    for x in batch:
        x.request.num_computed_tokens += x.num_tokens


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


def test_running_requests_go_first_and_a_decode_is_one_token():
    s = Scheduler(BlockManager(100, 4), max_num_seqs=8, max_num_batched_tokens=64)
    a = req("a", 5)
    s.add(a)
    run(s.schedule())
    a.token_ids.append(7)  # the step's new token: a is due for one more
    b = req("b", 6)
    s.add(b)
    batch = s.schedule()
    assert [(x.request.request_id, x.num_tokens, x.completes) for x in batch] == [("a", 1, True), ("b", 6, True)]
    decoding, prefill = split_batch(batch)
    assert decoding == [a] and [x.request for x in prefill] == [b]  # b's whole prompt is a prefill chunk


def test_a_chunk_that_stops_short_of_the_last_token_yields_nothing():
    s = Scheduler(BlockManager(100, 4), max_num_seqs=8, max_num_batched_tokens=4)
    a = req("a", 10)
    s.add(a)
    (chunk,) = s.schedule()
    assert chunk.num_tokens == 4 and not chunk.completes
    assert split_batch([chunk]) == ([], [chunk])
    # completes is fixed when scheduled: the commit changes the counters it was computed from
    run([chunk])
    assert ScheduledRequest(a, 6).completes and not chunk.completes


def test_a_request_with_nothing_due_is_not_scheduled():
    s = Scheduler(BlockManager(100, 4), max_num_seqs=8, max_num_batched_tokens=64)
    a = req("a", 3)
    s.add(a)
    run(s.schedule())
    assert s.schedule() == []  # its next token is not known yet
    assert s.has_unfinished()
    s.remove(a)
    assert not s.has_unfinished()


def test_admission_waits_for_blocks_without_losing_its_place():
    bm = BlockManager(2, 4)  # 8 slots
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    a, b = req("a", 6), req("b", 6)
    s.add(a)
    s.add(b)
    assert [x.request.request_id for x in s.schedule()] == ["a"]
    assert list(s.waiting) == [b] and b.status is RequestStatus.WAITING and not b.block_table
    s.remove(a)
    assert [x.request.request_id for x in s.schedule()] == ["b"]


def test_an_admitted_request_starts_from_the_cached_prefix():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    first = req("first", 9)
    s.add(first)
    run(s.schedule())
    bm.register(first)
    s.remove(first)  # its full blocks stay findable
    again = req("again", 9)
    s.add(again)
    (chunk,) = s.schedule()
    # two full blocks (8 tokens) are matched; the last token is always computed, for its logits
    assert again.num_computed_tokens == 8 and chunk.num_tokens == 1 and chunk.completes


@pytest.mark.parametrize("budget", [1, 3])
def test_the_token_budget_is_never_exceeded(budget):
    s = Scheduler(BlockManager(100, 4), max_num_seqs=8, max_num_batched_tokens=budget)
    for rid in "abc":
        s.add(req(rid, 5))
    for _ in range(20):
        batch = s.schedule()
        assert sum(x.num_tokens for x in batch) <= budget
        run(batch)
    assert all(r.num_computed_tokens == 5 for r in s.running)
