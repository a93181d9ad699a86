"""Planning a step: the policy sees a typed view of the decoding requests and the prefill beside them; its plan is
checked and capped (max_tokens, the request's own cap, the context, the step's budget, free KV blocks), and a
failing or nonsensical policy costs speculation for the step, never a request."""
import pytest

from smartspec.engine.planner import DraftRoom, Speculation, plan_step, step_view
from smartspec.engine.scheduler import ScheduledRequest
from smartspec.policy import FixedPolicy, Policy
from smartspec.runtime.block_manager import BlockManager
from smartspec.spec_decode.ngram import NgramProposer
from smartspec.spec_decode.suffix import SuffixProposer
from smartspec.types.plan import DRAFT, LOOKUP, RequestView, RequestViews, SpecPlan
from smartspec.types.request import Request
from smartspec.types.sampling_params import SamplingParams


def decoding(rid, n, **params):
    r = Request(rid, list(range(n)), SamplingParams(**{"max_tokens": 64, **params}), arrival_time=1.5)
    r.num_computed_tokens = n - 1  # due for its next token
    return r


class Answer(Policy):
    """Answers a fixed plan, whatever it is shown (and keeps what it was shown)."""
    name = "answer"

    def __init__(self, plan):
        self.answer, self.views = plan, []

    def plan(self, view):
        self.views.append(view)
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def test_the_view_holds_numbers_of_decoding_requests_and_the_prefill_beside_them():
    a = decoding("a", 10, k_cap=2)
    p = Request("p", list(range(30)), SamplingParams(), arrival_time=3.0)
    p.num_computed_tokens = 8
    view = step_view([a], [ScheduledRequest(p, 16)], k_max=4, now=9.0)
    (r,) = view.requests
    assert (r.request_id, r.num_tokens, r.num_output_tokens, r.max_tokens, r.k_cap,
            r.arrival_time) == ("a", 10, 0, 64, 2, 1.5)
    # 16 tokens from position 8: each attends over its own prefix (9 + 10 + ... + 24)
    assert (view.prefill_tokens, view.prefill_context) == (16, 264)
    assert [(x.request_id, x.arrival_time) for x in view.prefilling] == [("p", 3.0)]
    assert view.lookups is None and view.now == 9.0


def request_view(r):
    return RequestView(r.request_id, r.num_tokens, r.num_output_tokens, r.params.max_tokens, r.params.k_cap,
                       r.arrival_time)


def test_the_views_rows_are_made_when_first_read_and_its_ids_and_context_without_them():
    """A held plan reads the batch's ids and total context alone: the rows are not made for it, and once read
    they are each request's numbers."""
    reqs = [decoding(f"r{i}", 10 + i, k_cap=i or None) for i in range(5)]
    reqs[1].token_ids.extend([7, 7])  # two output tokens
    views = step_view(reqs, [], k_max=4).requests
    assert views.ids == ("r0", "r1", "r2", "r3", "r4") and len(views) == 5
    assert views.context == sum(r.num_tokens for r in reqs) == 10 + 13 + 12 + 13 + 14
    assert views._rows is None and views._columns is None  # nothing above read a row or the other columns
    assert list(views) == [request_view(r) for r in reqs] and views[1].num_output_tokens == 2
    made = RequestViews.of([request_view(r) for r in reqs])
    assert (made.ids, made.context, list(made)) == (views.ids, views.context, list(views))
    assert [list(c) for c in views.columns()] == [list(c) for c in made.columns()] == [list(c) for c in zip(*made)]


def test_ks_are_capped_and_their_blocks_reserved():
    blocks = BlockManager(64, 4)
    reqs = [decoding("long", 10), decoding("ending", 10, max_tokens=3), decoding("capped", 10, k_cap=1)]
    for r in reqs:
        blocks.allocate(r, r.num_tokens)
    spec = Speculation(NgramProposer(), FixedPolicy(5), 5)
    view, plan = plan_step(spec, reqs, [], DraftRoom(100, blocks, 13))
    # long: the context leaves room for 13 - 10 - 1 drafts; ending: max_tokens 3 leaves 2; capped: its own cap
    assert plan.ks == [2, 2, 1] and view is not None
    assert [len(r.block_table) for r in reqs] == [3, 3, 3]  # 10 + k tokens: blocks for the drafts reserved
    _, plan = plan_step(spec, [decoding("x", 10)], [], DraftRoom(3, blocks, 100))
    assert plan.ks == [3]  # the step's token budget


def test_free_blocks_cap_the_drafts():
    blocks = BlockManager(3, 4)
    r = decoding("r", 10)
    blocks.allocate(r, 10)  # 3 blocks, 12 slots: room for 2 drafts and no block left
    _, plan = plan_step(Speculation(NgramProposer(), FixedPolicy(5), 5), [r], [], DraftRoom(100, blocks, 100))
    assert plan.ks == [2] and blocks.num_free == 0


@pytest.mark.parametrize("answer", [RuntimeError("broken"), SpecPlan([9]), SpecPlan([1, 1]), SpecPlan([-1]),
                                    SpecPlan([1.5])])
def test_a_failing_or_nonsensical_policy_costs_only_speculation(answer):
    blocks = BlockManager(16, 4)
    r = decoding("r", 10)
    blocks.allocate(r, 10)
    view, plan = plan_step(Speculation(NgramProposer(), Answer(answer), 4), [r], [], DraftRoom(100, blocks, 100))
    assert view is None and plan.ks == [0] and plan.methods is None and len(r.block_table) == 3


def test_lookups_are_shown_before_the_plan_and_proposers_checked():
    r = decoding("r", 10)
    r.token_ids[:] = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1]
    blocks = BlockManager(16, 4)
    blocks.allocate(r, 10)
    policy = Answer(SpecPlan([2], [LOOKUP]))
    view, plan = plan_step(Speculation(SuffixProposer(4), policy, 4), [r], [], DraftRoom(100, blocks, 100))
    assert plan.ks == [2] and plan.methods == [LOOKUP]
    (tree,) = view.lookups
    assert tree.tokens[:2] == [2, 3] and not view.draft_available  # suffix alone: no draft model to choose
    # the draft model cannot be chosen where none is available
    _, plan = plan_step(Speculation(SuffixProposer(4), Answer(SpecPlan([2], [DRAFT])), 4), [r], [],
                        DraftRoom(100, blocks, 100))
    assert plan.ks == [0]


def test_no_proposer_or_no_decoding_asks_no_policy():
    policy = Answer(SpecPlan([1]))
    blocks = BlockManager(16, 4)
    assert plan_step(Speculation(None, policy, 4), [decoding("r", 5)], [], DraftRoom(100, blocks, 100))[1].ks == [0]
    assert plan_step(Speculation(NgramProposer(), policy, 4), [], [], DraftRoom(100, blocks, 100))[1].ks == []
    assert policy.views == []


def capped_in_turn(ks, decoding, room):
    """cap_and_reserve as first written: each request's caps through its properties, then the blocks it may take."""
    budget, blocks, out = room.budget, room.blocks, []
    for req, k in zip(decoding, ks):
        k = min(k, req.params.max_tokens - req.num_output_tokens - 1, room.max_model_len - req.num_tokens - 1, budget)
        if req.params.k_cap is not None:
            k = min(k, req.params.k_cap)
        k = max(0, min(k, (len(req.block_table) + blocks.num_free) * blocks.block_size - req.num_tokens))
        if k:
            blocks.allocate(req, req.num_tokens + k)
        budget -= k
        out.append(k)
    return out


@pytest.mark.parametrize("seed", range(40))
def test_capping_matches_capping_through_each_requests_properties(seed):
    """cap_and_reserve, reading the requests' lists directly and the block manager only where drafts cross into a
    new block, gives the draft lengths and block tables of the plain rule, whichever caps bind: max_tokens, the
    request's own cap, the context, the step's budget, and free blocks plentiful or short."""
    import copy
    import random

    from smartspec.engine.planner import cap_and_reserve
    rng = random.Random(seed)
    blocks = BlockManager(rng.choice([6, 12, 40, 400]), rng.choice([1, 4, 16]))
    reqs = []
    for i in range(rng.randint(1, 12)):
        n = rng.randint(2, 40)
        r = decoding(f"r{i}", n, max_tokens=rng.randint(1, 30), k_cap=rng.choice([None, None, 0, 1, 3]))
        r.token_ids.extend([1] * rng.randint(0, 5))  # some output already
        if not blocks.can_hold(r, r.num_tokens):
            break
        blocks.allocate(r, r.num_tokens)
        reqs.append(r)
    if seed % 2:  # free blocks short: another request holds all but a few
        blocks.allocate(decoding("other", 1), (blocks.num_free - rng.randint(0, 3)) * blocks.block_size)
    ks = [rng.randint(0, 8) for _ in reqs]
    room = (rng.choice([0, 3, 10, 1000]), rng.choice([20, 45, 1000]))
    twin_blocks, twin_reqs = copy.deepcopy((blocks, reqs))
    got = cap_and_reserve(ks, reqs, DraftRoom(room[0], blocks, room[1]))
    want = capped_in_turn(ks, twin_reqs, DraftRoom(room[0], twin_blocks, room[1]))
    assert got == want and all(type(k) is int for k in got)
    assert [r.block_table for r in reqs] == [r.block_table for r in twin_reqs]
    assert blocks.num_free == twin_blocks.num_free
