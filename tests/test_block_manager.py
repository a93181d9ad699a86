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


def test_registering_a_step_at_a_time_finds_what_walking_every_block_finds():
    """register() walks only the blocks committed since its last call; over decoding with drafts rejected
    (truncations), preemptions (free) and requests sharing a prompt, the blocks it makes findable, and the requests
    that then match them, are those of walking each request's whole table every time."""
    import random

    def run(walk_all: bool) -> tuple[dict, list[int]]:
        rng = random.Random(7)
        bm = BlockManager(28, 4, enable_prefix_caching=True)  # few: freed blocks are soon evicted and reused
        shared = [rng.randrange(5) for _ in range(10)]

        def start(i: int) -> Request:
            r = Request(f"r{i}", shared + [i % 3], SamplingParams())
            bm.match_prefix(r, r.num_tokens - 1)
            bm.allocate(r, r.num_tokens)
            r.num_computed_tokens = r.num_tokens
            return r

        reqs, paused = [start(i) for i in range(3)], set()
        for step in range(400):
            i = rng.randrange(3)
            r = reqs[i]
            if i in paused and rng.random() < 0.1:  # back from preemption: it matches what is still cached
                paused.discard(i)
                bm.match_prefix(r, r.num_tokens - 1)
                bm.allocate(r, r.num_tokens - 1)
                r.num_computed_tokens = r.num_tokens - 1  # and computes the rest
            if i in paused:  # still waiting (long enough that others' allocations evict some of its blocks)
                continue
            if r.num_tokens > 28:  # finished: a new request in its place
                bm.free(r)
                r = reqs[i] = start(step + 3)
            elif rng.random() < 0.1 and not paused:  # preempted: its blocks go back while the others run on
                bm.free(r)
                paused.add(i)
                continue
            drafts = [rng.randrange(5) for _ in range(rng.randrange(4))]
            bm.allocate(r, r.num_tokens + 1 + len(drafts))
            kept = rng.randrange(len(drafts) + 1)
            r.token_ids += [rng.randrange(5)] + drafts[:kept]
            bm.truncate(r, r.num_tokens)
            r.num_computed_tokens = r.num_tokens - 1
            if walk_all:
                bm._walked.clear()
            bm.register(r)
        for i, r in enumerate(reqs):
            if i not in paused:
                bm.free(r)
        late = Request("late", list(reqs[0].token_ids), SamplingParams())
        return dict(bm._key), [bm.match_prefix(late, late.num_tokens - 1)]

    assert run(walk_all=False) == run(walk_all=True)
    keys, matched = run(walk_all=False)
    assert len(keys) > 10 and matched[0] > 8  # the test can fail: blocks were registered and found


def test_a_twin_block_becomes_findable_when_the_block_it_duplicated_is_evicted():
    """Two requests prefilled the same prompt at once: the first registers its blocks, the second's hold the same
    tokens and wait. When the first's are evicted, the second's are registered at its next step, and a new request
    with that prompt finds them."""
    bm = BlockManager(6, 4, enable_prefix_caching=True)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    a, b = Request("a", list(prompt), SamplingParams()), Request("b", list(prompt), SamplingParams())
    for r in (a, b):
        bm.allocate(r, r.num_tokens)
        r.num_computed_tokens = r.num_tokens
        bm.register(r)
    assert set(bm._key) == set(a.block_table[:2])  # b's first two blocks are a's twins
    bm.free(a)
    bm.allocate(Request("other", [0] * 12, SamplingParams()), 12)  # takes the free blocks: a's are evicted
    assert not bm._key
    bm.register(b)
    assert set(bm._key) == set(b.block_table[:2])
    late = Request("late", list(prompt), SamplingParams())
    assert bm.match_prefix(late, late.num_tokens - 1) == 8 and late.block_table == b.block_table[:2]


def test_cached_tokens_is_what_match_prefix_takes_and_takes_nothing():
    """A look at the cache: for prompts sharing 0, 1, 2 and 3 full blocks with one that was cached and freed, the
    tokens match_prefix then takes, with no block taken, counted or evicted by the look."""
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    first = Request("first", list(range(100, 113)), SamplingParams())
    bm.allocate(first, first.num_tokens)
    first.num_computed_tokens = first.num_tokens
    bm.free(first)
    for shared in range(4):
        ids = list(range(100, 100 + 4 * shared)) + [7] * (13 - 4 * shared)
        free, queries = bm.num_free, bm.num_prefix_queries
        looked = bm.cached_tokens(ids, len(ids) - 1)
        assert bm.num_free == free and bm.num_prefix_queries == queries
        late = Request(f"late{shared}", ids, SamplingParams())
        assert looked == bm.match_prefix(late, late.num_tokens - 1) == 4 * shared
        bm.free(late)
    assert BlockManager(8, 4).cached_tokens(list(range(100, 113)), 12) == 0  # no prefix caching: nothing


def test_a_block_table_reads_as_the_list_it_stands_for():
    """Random appends (past its array's first size), pops and clears: the table reads as a list kept alongside
    (length, truth, indexing from either end, slices, iteration both ways, equality, its array, a pickled copy);
    an index past either end and a pop of an empty table raise as a list's do."""
    import pickle
    import random

    from smartspec.types.block_table import BlockTable

    rng = random.Random(0)
    table, mirror = BlockTable([5, 6]), [5, 6]
    for step in range(3000):
        roll = rng.random()
        if roll < 0.6:
            block = rng.randrange(10 ** 6)
            table.append(block)
            mirror.append(block)
        elif roll < 0.97 and mirror:
            assert table.pop() == mirror.pop()
        elif roll >= 0.97:
            table.clear()
            mirror.clear()
        assert len(table) == len(mirror) and bool(table) == bool(mirror) and table == mirror and mirror == table
        if mirror:
            i = rng.randrange(-len(mirror), len(mirror))
            a, b = sorted(rng.randrange(-len(mirror) - 2, len(mirror) + 2) for _ in range(2))
            assert table[i] == mirror[i] and table[a:b] == mirror[a:b] and table[::-3] == mirror[::-3]
            assert list(table) == mirror and list(reversed(table)) == mirror[::-1]
            assert table.array().tolist() == mirror and pickle.loads(pickle.dumps(table)) == mirror
    assert table != mirror + [1] and len(table.array()) == len(mirror)
    with pytest.raises(IndexError):
        table[len(mirror)]
    table.clear()
    with pytest.raises(IndexError):
        table.pop()
