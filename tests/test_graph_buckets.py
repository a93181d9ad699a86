"""The bucket planner (runtime/graph_buckets.py): every decode and verify step the limits allow has a bucket that
holds it, the plan stays within its cap, the least used rungs go first, and the policy's pricing grid is the plan's."""
import itertools
import random

import pytest

from smartspec.runtime.graph_buckets import BucketLimits, plan_buckets

GPU = BucketLimits(max_rows=64, max_width=5, max_kv=4096, block_size=16, trees=True)  # config-gpu.yaml, k_max 4


def every_step(limits: BucketLimits):
    """Every (rows, widest row, longest context, tree) a step within the limits can have."""
    return itertools.product(range(1, limits.max_rows + 1), range(1, limits.max_width + 1),
                             range(1, limits.max_kv + 1), (False, True) if limits.trees else (False,))


@pytest.mark.parametrize("cap", [1, 7, 48, 96, 10**6])
def test_every_step_has_a_bucket_that_holds_it_within_the_cap(cap):
    limits = BucketLimits(max_rows=24, max_width=5, max_kv=300, block_size=16, trees=True, cap=cap)
    plan = plan_buckets(limits)
    buckets = set(plan.buckets())
    assert len(buckets) == len(plan) <= cap
    for rows, width, kv, tree in every_step(limits):
        b = plan.bucket(rows, width, kv, tree)
        assert b in buckets and b.rows >= rows and b.width >= width and b.kv_width >= kv and b.trees >= tree
        assert b.kv_width % limits.block_size == 0


def test_random_limits_are_covered_by_their_tops():
    rng = random.Random(0)
    for _ in range(200):
        limits = BucketLimits(max_rows=rng.randint(1, 600), max_width=rng.randint(1, 65),
                              max_kv=rng.randint(1, 40_000), block_size=rng.choice([1, 4, 16, 32]),
                              trees=rng.random() < 0.5, cap=rng.randint(1, 300))
        plan = plan_buckets(limits)
        assert len(plan) <= limits.cap
        assert plan.rows[-1] == limits.max_rows and plan.widths[-1] == limits.max_width
        assert limits.max_kv <= plan.kv_widths[-1] < limits.max_kv + limits.block_size
        assert plan.trees[-1] == limits.trees
        for ladder in (plan.rows, plan.widths, plan.kv_widths):
            assert list(ladder) == sorted(set(ladder))
        assert plan.bucket(limits.max_rows + 1, 1, 1, False) is None
        assert plan.bucket(1, limits.max_width + 1, 1, False) is None  # a prefill chunk runs eagerly


def test_the_whole_grid_and_the_capped_plan_of_a_gpu_config():
    """64 rows x 4,096 positions with k_max 4 span 480 buckets with trees; the default cap keeps 96 at most, and
    every ladder keeps its top."""
    whole = plan_buckets(BucketLimits(**{**GPU.__dict__, "cap": 10**6}))
    assert len(whole) == 10 * 4 * 6 * 2
    assert whole.rows == (1, 2, 4, 8, 12, 16, 24, 32, 48, 64) and whole.kv_widths == (128, 256, 512, 1024, 2048, 4096)
    capped = plan_buckets(GPU)
    assert len(capped) <= 96 and capped.rows[-1] == 64 and capped.widths[-1] == 5 and capped.kv_widths[-1] == 4096


def test_rungs_leave_in_one_order_whatever_the_cap():
    """The cap only says when to stop: a lower cap's ladders are within a higher cap's."""
    plans = [plan_buckets(BucketLimits(**{**GPU.__dict__, "cap": cap})) for cap in (480, 200, 96, 48, 12, 1)]
    for wide, narrow in zip(plans, plans[1:]):
        for a, b in zip((wide.rows, wide.widths, wide.kv_widths, wide.trees),
                        (narrow.rows, narrow.widths, narrow.kv_widths, narrow.trees)):
            assert set(b) <= set(a)
    assert len(plans[-1]) == 1


def test_the_least_used_rung_goes_first():
    """Rows are expected in proportion to 1/n: one row (a fifth of the steps at 64 rows) is padded to two only after
    12, 24 and 48 rows (each a few per cent, padded by a third) have gone up to the next rung."""
    order = []
    previous = plan_buckets(BucketLimits(**{**GPU.__dict__, "trees": False, "cap": 10**6}))
    for cap in range(len(previous) - 1, 0, -1):
        plan = plan_buckets(BucketLimits(**{**GPU.__dict__, "trees": False, "cap": cap}))
        order += sorted(set(previous.rows) - set(plan.rows))
        previous = plan
    assert order.index(12) < order.index(1) and order.index(24) < order.index(1) and order.index(48) < order.index(1)


def test_the_policys_pricing_grid_is_the_plans():
    plan = plan_buckets(GPU)
    for rows, width in itertools.product(range(1, 65), range(1, 6)):
        b = plan.bucket(rows, width, 100, False)
        assert plan.shapes.bucket(rows, width) == (b.rows, b.width)


@pytest.mark.parametrize("field", ["max_rows", "max_width", "max_kv", "block_size", "cap"])
def test_limits_are_checked(field):
    with pytest.raises(ValueError, match=field):
        BucketLimits(**{**GPU.__dict__, field: 0})
