"""The buckets decode and verify steps are padded to (runtime/cuda_graphs.py), planned once, at start, from the
configuration.

A bucket is rows x width x kv_width, with or without token-tree masks. The plan is a grid of four ladders (rows,
widths, kv widths, trees), each topped by the most the configuration lets a step form: max_num_seqs rows, 1 + k_max
tokens a row, max_model_len cache positions, tree masks where trees or request hints can come. So every decode and
verify step the scheduler can form has a bucket: every graph is captured at start, none while serving, and no such
step runs eagerly for want of one. A step with a row wider than the widest rung (a prefill chunk, a draft model's long
catch-up) runs eagerly: it is bound by compute, a graph gains it little, and padding every row of the batch to its
width would multiply the step's work.

The whole grid of a large configuration is hundreds of buckets (64 rows x 4,096 positions with k_max 4: 480 with
trees), each a capture at start. Under the cap, rungs come out of the ladders one at a time, the least used first:
a step that would have run in a removed rung runs in the next rung up, so the rung to go is the one that adds the
least padded work over the steps expected on it, never a ladder's top (coverage). Expected use is a prior, as no
step has run at start: every load from one row to max_num_seqs equally likely in its order of magnitude (a row count
n in proportion to 1/n), every width and every context length equally likely. A grid keeps the policy's pricing
exact: a step's cells are its rows' rung times its width's rung (PaddedShapes)."""
from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass

from smartspec.types.padding import PaddedShapes

ROW_RUNGS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
MIN_KV_WIDTH = 128  # cache positions attended: a power of two from here, up to what a request can reach
KV_PER_TOKEN_WORK = 512  # positions a token attends that cost about what its share of the linears costs (a rough
#                           weight: it only orders the rungs' removal)
TREE_WORK = 1.05  # a tree bucket's work over a chain bucket's (the masks' reads)
DEFAULT_CAP = 96


@dataclass(frozen=True)
class Bucket:
    rows: int
    width: int
    kv_width: int
    trees: bool


@dataclass(frozen=True)
class BucketLimits:
    """What the scheduler can form: up to max_rows sequences a step, max_width query tokens a decode or verify row,
    max_kv cache positions a row attends; tree masks where `trees`. At most `cap` buckets."""
    max_rows: int
    max_width: int
    max_kv: int
    block_size: int
    trees: bool
    cap: int = DEFAULT_CAP

    def __post_init__(self) -> None:
        for name in ("max_rows", "max_width", "max_kv", "block_size", "cap"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"bucket limits: {name} must be a positive integer, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class BucketPlan:
    rows: tuple[int, ...]  # each ladder ascending; its top is the limit
    widths: tuple[int, ...]
    kv_widths: tuple[int, ...]
    trees: tuple[bool, ...]  # (False, True), (True,): chains run in tree buckets too, or (False,)

    def buckets(self) -> list[Bucket]:
        """Every bucket of the plan, the largest first (captured in that order, later graphs reuse the memory the
        first one took)."""
        return sorted((Bucket(*b) for b in itertools.product(self.rows, self.widths, self.kv_widths, self.trees)),
                      key=lambda b: (-b.rows * b.width * b.kv_width, -b.trees, b.rows, b.width))

    def bucket(self, rows: int, width: int, kv: int, tree: bool) -> Bucket | None:
        """The smallest bucket that holds a step of `rows` sequences, its widest `width` tokens, its longest
        attending `kv` positions; None where a row is wider than the widest rung (it runs eagerly)."""
        if rows > self.rows[-1] or width > self.widths[-1] or kv > self.kv_widths[-1] or (tree and not self.trees[-1]):
            return None
        return Bucket(_rung(self.rows, rows), _rung(self.widths, width), _rung(self.kv_widths, kv),
                      tree or self.trees[0])

    @property
    def shapes(self) -> PaddedShapes:
        """The rows x width buckets, for the policy's pricing."""
        return PaddedShapes(self.rows, self.widths, self.rows[-1] * self.widths[-1])

    def __len__(self) -> int:
        return len(self.rows) * len(self.widths) * len(self.kv_widths) * len(self.trees)


def plan_buckets(limits: BucketLimits) -> BucketPlan:
    """Every rung the limits allow, then the least used rungs out until the plan is within the cap (see the module
    docstring); a cap below the four tops' one bucket keeps that one."""
    block = limits.block_size
    top_kv = -(-limits.max_kv // block) * block
    kv = sorted({-(-w // block) * block for w in _powers(MIN_KV_WIDTH, top_kv)} | {top_kv})
    ladders = [[r for r in ROW_RUNGS if r < limits.max_rows] + [limits.max_rows],
               [w for w in _powers(1, limits.max_width) if w < limits.max_width] + [limits.max_width],
               [w for w in kv if w <= top_kv], [False, True] if limits.trees else [False]]
    usage = {(i, r): _prior(ladder, r, i) for i, ladder in enumerate(ladders) for r in ladder}
    while math.prod(len(ladder) for ladder in ladders) > limits.cap:
        candidates = [(i, j) for i, ladder in enumerate(ladders) for j in range(len(ladder) - 1)]
        if not candidates:
            break
        i, j = min(candidates, key=lambda c: _removal_cost(ladders, usage, *c))
        removed, up = ladders[i][j], ladders[i][j + 1]
        usage[(i, up)] += usage.pop((i, removed))
        del ladders[i][j]
    return BucketPlan(*(tuple(ladder) for ladder in ladders))


def _powers(start: int, top: int) -> list[int]:
    """start, 2 start, 4 start, ... up to the first at or past top."""
    out = [start]
    while out[-1] < top:
        out.append(out[-1] * 2)
    return out


def _rung(ladder: tuple[int, ...], value: int) -> int:
    return ladder[bisect.bisect_left(ladder, value)]


def _prior(ladder: list, rung, dim: int) -> float:
    """The prior share of steps that run in a rung of ladder `dim` (0 rows, 1 widths, 2 kv widths, 3 trees): the
    values it covers, from the rung below it (exclusive) to itself; rows weighted 1/n, the rest uniformly."""
    if dim == 3:
        return 1.0 / len(ladder)
    at = ladder.index(rung)
    below = ladder[at - 1] if at else 0
    if dim == 0:
        weight = sum(1.0 / n for n in range(below + 1, rung + 1))
        return weight / sum(1.0 / n for n in range(1, ladder[-1] + 1))
    return (rung - below) / ladder[-1]


def _work(dim: int, rung) -> float:
    """A rung's factor in a bucket's work: rows x width x (1 + kv / KV_PER_TOKEN_WORK) x TREE_WORK if trees."""
    if dim == 2:
        return 1.0 + rung / KV_PER_TOKEN_WORK
    if dim == 3:
        return TREE_WORK if rung else 1.0
    return float(rung)


def _removal_cost(ladders: list[list], usage: dict, dim: int, j: int) -> float:
    """The expected relative extra work of running rung j's steps in the rung above: the work is a product over the
    ladders, so it grows by the one factor's ratio for every step that ran there."""
    rung, up = ladders[dim][j], ladders[dim][j + 1]
    return usage[(dim, rung)] * (_work(dim, up) / _work(dim, rung) - 1.0)
