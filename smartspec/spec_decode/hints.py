"""Drafts a request carries with it, found before the policy plans, at no forward's cost: the tokens its grammar
forces (jump-forward decoding: keys, braces, `": "`) and the continuation of its predicted output (OpenAI's
`prediction`: the text the client expects back, typically the file being edited).

They reach the policy as lookups (`StepView.lookups`), beside the configured proposer's own: the policy prices each
request's hint chain by its calibrated confidence (no draft cost) against the configured proposer and chooses per
request, as it chooses between a draft model and suffix speculation. Hints are verified like any draft, so output
is unchanged; a forced token the target tokenizes differently is simply rejected."""
from __future__ import annotations

from dataclasses import dataclass

from smartspec.spec_decode.suffix import SuffixIndex, best_continuation
from smartspec.structured.matcher import RequestGrammar
from smartspec.types.request import Request
from smartspec.types.tree import MAX_TREE_NODES, TokenTree

GRAMMAR = "grammar"  # Draft.source of forced tokens
PREDICTION = "prediction"  # Draft.source of a predicted output's tokens
EMPTY = TokenTree([], [], [])
LIKELY = 0.9  # the confidence of forced bytes' usual tokenization, past the certain forced tokens


@dataclass
class Hint:
    """A request's hint chain this step, and where it came from."""
    tree: TokenTree
    source: str | None  # GRAMMAR, PREDICTION, or None (no hint)


class RequestHints:
    """The engine's predicted outputs (indexed to find where the output has got to in them) and, each step, every
    decoding request's best hint."""

    def __init__(self) -> None:
        self.predictions: dict[str, SuffixIndex] = {}  # request -> its prediction, indexed under its id

    def add_prediction(self, request_id: str, tokens: list[int]) -> None:
        if tokens:
            index = SuffixIndex()
            index.extend(request_id, tokens)
            self.predictions[request_id] = index

    def release(self, request_id: str) -> None:
        self.predictions.pop(request_id, None)

    def step_hints(self, requests: list[Request], grammars: dict[str, RequestGrammar], budget: int) \
            -> list[Hint] | None:
        """Per decoding request its hint (an empty tree where it has none); None when no request has one, so a
        step without hints plans exactly as before."""
        if not self.predictions and not grammars:
            return None
        hints = [self._hint(r, grammars.get(r.request_id), min(budget, MAX_TREE_NODES)) for r in requests]
        return hints if any(h.source for h in hints) else None

    def _hint(self, req: Request, grammar: RequestGrammar | None, budget: int) -> Hint:
        if budget <= 0:
            return Hint(EMPTY, None)
        if grammar is not None:
            forced, certain = grammar.forced_tokens()
            if forced := forced[:budget]:
                return Hint(TokenTree.chain(forced, [1.0 if i < certain else LIKELY for i in range(len(forced))]),
                            GRAMMAR)
        index = self.predictions.get(req.request_id)
        if index is None:
            return Hint(EMPTY, None)
        if not req.num_output_tokens:  # nothing to align yet: the prediction's start
            return Hint(TokenTree.chain(index.seqs[req.request_id][:budget]), PREDICTION)
        found = index.occurrences(req.token_ids)
        if not found:
            return Hint(EMPTY, None)
        tree = best_continuation(found, budget, 1, budget)
        return Hint(tree, PREDICTION if len(tree) else None)
