"""What the policy sees of a step, and what it answers: numbers only, so a policy can be tested, simulated and
replaced without an engine. The engine builds a `StepView` from its requests (engine/planner.py), the policy
returns a `SpecPlan`, and the engine reports the step back as a `StepRecord`."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from smartspec.types.padding import PaddedShapes
    from smartspec.types.tree import TokenTree

# the proposers a policy can choose between per request (method names of SpeculativeConfig)
DRAFT = "draft_model"
LOOKUP = "suffix"


def chunk_context(start: int, tokens: int) -> int:
    """A prefill chunk's context as the step-cost model counts it: the positions its tokens attend over, summed
    (token i of a chunk fed at `start` attends over start + i + 1). A decoding row reads its context once a step and
    counts as start + its tokens; a chunk of hundreds of tokens attends over it once per token. Counted as a row's,
    the chunks of a long prompt, each costlier than the last, tell the fit that a context token costs what a
    chunk's hundreds of tokens pay for it, and a decode step at that context is priced several times its cost (the
    1.5B after an 1,800-token prompt: 0.29 s predicted for a 0.05 s step). One token (start + 1) counts as a row."""
    return tokens * start + tokens * (tokens + 1) // 2


def fed_context(start: int, tokens: int, prefill: bool) -> int:
    """The context one request's part of a step counts for in the step-cost model: a prefill chunk's by
    chunk_context, a decoding row's (its last token and drafts, fed at `start`) as start + tokens."""
    return chunk_context(start, tokens) if prefill else start + tokens


class RequestView(NamedTuple):
    """A decoding request as the policy sees it. (A named tuple: the engine builds one per decoding request every
    step, at a fifth of a frozen dataclass's cost.)"""
    request_id: str
    num_tokens: int  # prompt + output so far (its context once the step's last token is fed)
    num_output_tokens: int
    max_tokens: int
    k_cap: int | None  # the request's own cap on k (None: none; the engine's is StepView.k_max)
    arrival_time: float


_new_tuple = tuple.__new__
_UNREAD = object()  # RequestViews.draft_held before it is asked for


class RequestViews(Sequence):
    """StepView.requests: the decoding requests' RequestViews in the step's order, kept as columns (a flat array per
    field over the batch) and made into rows only when a row is read. The ids and the contexts come with the view;
    the other columns are taken from the requests when first read (`columns`): a step whose plan is held reads the
    ids and the total context alone, a full plan reads the columns, and neither makes a row per request (at 256
    requests making the rows was most of a held step's policy time, and a fifth of a full plan's)."""

    __slots__ = ("_source", "_rest_of", "_held_of", "_held", "_columns", "_rows", "ids", "num_tokens", "context")

    def __init__(self, source: list, ids: tuple[str, ...], num_tokens: list[int],
                 rest_of: Callable[[list], tuple],
                 held_of: Callable[[list], list[int] | None] | None = None) -> None:
        """source: the requests, in order; ids and num_tokens: their RequestView fields; rest_of(source): the
        other fields' columns in RequestView's order (num_output_tokens, max_tokens, k_cap, arrival_time);
        held_of(source): the draft_held column (None: there is none)."""
        self._source, self._rest_of, self._columns, self._rows = source, rest_of, None, None
        self._held_of, self._held = held_of, _UNREAD
        self.ids, self.num_tokens, self.context = ids, num_tokens, sum(num_tokens)

    @property
    def draft_held(self) -> Sequence[int] | None:
        """Per request, the tokens of its context a draft model would not read before drafting for it now: those
        it holds state for, or else those its prefix cache holds (Proposer.held_tokens); None where the proposer
        keeps neither. Asked of the proposer when first read: a full plan reads it, a held one does not."""
        if self._held is _UNREAD:
            self._held = None if self._held_of is None else self._held_of(self._source)
        return self._held

    @classmethod
    def of(cls, rows: Sequence[RequestView]) -> RequestViews:
        """Views already made (tests, a simulator of its own)."""
        if isinstance(rows, RequestViews):
            return rows
        rows = list(rows)
        columns = tuple(zip(*rows)) if rows else ((),) * len(RequestView._fields)
        views = cls(rows, columns[0], list(columns[1]), lambda _: columns[2:])
        views._rows = rows
        return views

    def columns(self) -> tuple[Sequence, ...]:
        """One sequence per RequestView field, in its order, each over the batch."""
        if self._columns is None:
            self._columns = (self.ids, self.num_tokens, *self._rest_of(self._source))
        return self._columns

    def joined(self, other: RequestViews) -> RequestViews:
        """These requests, then `other`'s, as one batch."""
        if self._rest_of is other._rest_of and self._held_of == other._held_of:
            return RequestViews(self._source + other._source, self.ids + other.ids, self.num_tokens + other.num_tokens,
                                self._rest_of, self._held_of)
        return RequestViews.of([*self, *other])

    def _made(self) -> list[RequestView]:
        if self._rows is None:
            self._rows = list(map(_new_tuple, repeat(RequestView), zip(*self.columns())))
        return self._rows

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return self._made()[i]

    def __iter__(self):
        return iter(self._made())

    def __eq__(self, other) -> bool:
        return list(self) == list(other) if isinstance(other, (RequestViews, list, tuple)) else NotImplemented

    def __repr__(self) -> str:
        return f"RequestViews({self._made()!r})"


@dataclass(frozen=True)
class PrefillView:
    """A request whose prompt chunk rides in the step (it yields no drafts)."""
    request_id: str
    arrival_time: float


@dataclass(frozen=True)
class StepView:
    """One step as the policy sees it, before it chooses."""
    requests: RequestViews  # the decoding requests, in the step's order (a list of RequestView is taken as such)
    k_max: int  # the most any request speculates (draft tokens, or tree nodes); K in the paper's notation
    prefill_tokens: int = 0  # tokens of the step's prefill chunks, which the verify forward carries anyway
    prefill_context: int = 0  # their context, summed over their tokens (chunk_context)
    prefilling: list[PrefillView] = field(default_factory=list)
    now: float | None = None  # the clock of arrival_time (None: time.monotonic(); a simulator passes its own)
    # Model-free lookups run before the policy chooses (suffix speculation beside a draft model): each request's
    # candidate tree. None: the proposer has no lookups; the plan is a k per request.
    lookups: list[TokenTree] | None = None
    draft_available: bool = False  # with lookups: whether the draft model can be chosen this step
    # the buckets the target's forward is padded to (CUDA graphs): a step is priced by the cells it computes, so
    # one long chain that widens every row is priced as such. None: steps run as they come
    shapes: PaddedShapes | None = None
    # the prefilling requests whose prompt this step completes: the next step's newcomers, as they are now (what a
    # policy may plan for them beside this step's forward). None: none, or not told
    joining: RequestViews | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "requests", RequestViews.of(self.requests))


@dataclass
class SpecPlan:
    """The policy's answer: k per decoding request (0 = none) and, where it chose them, the proposer of each."""
    ks: list[int]
    methods: list[str] | None = None  # DRAFT or LOOKUP per request, when the view offered lookups
    predicted_s: float | None = None  # the step's time as the policy predicts it, when it predicts
    # the requests whose k > 0 is an exploration probe, not a choice on the evidence (the record carries them back,
    # so what the policy learns of a probe's outcome reaches observe with it)
    probes: list[str] = field(default_factory=list)

    @classmethod
    def none(cls, view: StepView) -> SpecPlan:
        """No speculation for anyone (a policy with nothing measured yet, or a failed one)."""
        b = len(view.requests)
        return cls([0] * b, [LOOKUP] * b if view.lookups is not None else None)


@dataclass
class TreePlan:
    """Token trees after the policy weighed their nodes: what to verify, and the step's predicted time."""
    trees: list[TokenTree]
    predicted_s: float | None = None
