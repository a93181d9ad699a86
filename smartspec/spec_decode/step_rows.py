"""A step's rows on their way to the accept stage's one host read (spec_decode/accept.py builds them): each row's
liveness and chosen token (argmax, a controlled request's from its reshaped rows, a seeded request's draw), the
sampled chains' verdicts, the sampled trees' walks and the plain rows' draws stay on the device until one
`tolist`; then each request's part of the read becomes its new tokens, or its fault: a part whose tokens came from
a row with no finite logit ends with a fault naming what left it empty (the model, or its controls)."""
from __future__ import annotations

from typing import NamedTuple

import torch

from smartspec.runtime.sampler import RowControls, draw_tokens, seeded_draws, target_probs, target_probs_rows
from smartspec.spec_decode.controlled import Reshaped
from smartspec.spec_decode.proposer import Draft
from smartspec.spec_decode.rejection_sampler import accept_tree_sampled, greedy_path, greedy_run, sampled_verdict
from smartspec.spec_decode.sampled_chains import StagedChains
from smartspec.spec_decode.sampled_trees import StagedTrees
from smartspec.structured.matcher import RequestGrammar
from smartspec.types.faults import RequestFault, fault_of, stage
from smartspec.types.logprobs import rows_of_new_tokens
from smartspec.types.request import Request


class Verdicts(NamedTuple):
    """What the accept stage hands the commit stage."""
    tokens: dict[str, list[int]]  # request -> its new tokens (accepted drafts + the target's one)
    faults: dict[str, RequestFault]  # request -> why it ends in this step instead (its part of the step failed)


class Part(NamedTuple):
    """A request's logits rows in the step, and what reads them after the step's one host read."""
    request: Request
    draft: Draft | None
    start: int
    count: int
    verdict_at: int | None = None  # a sampled chain: where its [accepted, token] pair sits in the read


class WalkedTrees(NamedTuple):
    """The sampled trees walked together: where their answer sits in the step's read, and each one's column."""
    at: int
    staged: StagedTrees
    columns: dict[str, int]

    def tokens_of(self, rid: str, host: list[int]) -> list[int]:
        return self.staged.tokens_of(host, self.at, self.columns[rid])


class StepRows:
    """A step's rows on their way to its one host read: each row's liveness and chosen token (argmax, a
    controlled request's from its reshaped rows, a seeded request's draw), the sampled chains' verdicts and the
    plain rows' draws; and what reads each request's part of the read."""

    def __init__(self, logits: torch.Tensor, reshaped: Reshaped, faults: dict[str, RequestFault], plain: list[Part],
                 plain_rows: torch.Tensor | None, plain_controls: RowControls | None) -> None:
        """reshaped: the controlled rows (ControlledParts.rows); plain: the parts drawn together (unseeded, sampled,
        no draft), plain_rows their first rows on the device and plain_controls their sampling controls (sent with
        the step's values)."""
        self.logits, self.reshaped, self.faults = logits, reshaped.by_request, faults
        self.live = torch.isfinite(logits.amax(dim=-1))  # False: a NaN, a +inf, or no finite logit at all
        self.chosen = logits.argmax(dim=-1)
        if self.reshaped:  # the controlled requests' rows: their own liveness and argmax, in their places
            at_rows, blocks = reshaped.places, reshaped.rows
            if at_rows is None:  # their places were not staged: made here, a range a request
                at_rows = torch.cat([torch.arange(start, start + len(block), device=self.chosen.device)
                                     for start, block in self.reshaped.values()])
                blocks = torch.cat([block for _, block in self.reshaped.values()])
            self.live = self.live.index_put((at_rows,), torch.isfinite(blocks.amax(dim=-1)))
            self.chosen = self.chosen.index_put((at_rows,), blocks.argmax(dim=-1))
        self.seeded: list[tuple[Part, torch.Tensor]] = []  # seeded parts and their probabilities, drawn together
        self.on_device: list[torch.Tensor] = []  # what the read brings after chosen and live
        self.at = 2 * logits.shape[0]  # where the next of them sits in the read
        self.out: dict[str, list[int]] = {}  # sampled trees' tokens (they read on their own)
        self.later: list[Part] = []  # parts read from the step's read
        self.plain, self.plain_rows, self.plain_controls = plain, plain_rows, plain_controls
        self.sampled_p: torch.Tensor | None = None  # the sampled parts' target probabilities, made together,
        self.probs: dict[str, torch.Tensor] = {}  # and each part's rows of them (sample_probs)
        self.chain_at: dict[str, int] = {}  # where each sampled chain's verdict, made together, sits in the read
        self.walked: WalkedTrees | None = None  # the sampled trees walked together

    def rows_of(self, rid: str, start: int, n: int) -> torch.Tensor:
        """A request's logits rows as its sampling reads them: reshaped by its controls, else the model's."""
        return self.reshaped[rid][1] if rid in self.reshaped else self.logits[start:start + n]

    def sample_probs(self, parts: list[Part], controls: RowControls) -> None:
        """The sampled parts' target probabilities in one pass over all their rows (target_probs_rows: each row
        bitwise its own request's alone), by request; where that pass fails, each part's are made alone as it is
        taken (a failure there is that request's)."""
        try:
            rows = torch.cat([self.rows_of(p.request.request_id, p.start, p.count) for p in parts])
            live = torch.cat([self.live[p.start:p.start + p.count] for p in parts])
            probs = target_probs_rows(sampleable(rows, live), controls)
        except Exception:  # told apart in take, request by request
            return
        self.sampled_p = probs
        self.probs = dict(zip((p.request.request_id for p in parts), probs.split([p.count for p in parts])))

    def verify_chains(self, chains: list[Part], staged: StagedChains, sent: list[torch.Tensor]) -> None:
        """The sampled chains' verdicts in one pass (sampled_chains.py: each bitwise the rule's alone), put in the
        read; where the probabilities were not made together or the pass fails, each chain is verified alone as it
        is taken (a failure there is its own)."""
        try:
            if len(chains) == 1:  # the rule alone: fewer operations than the batched pass (its draft sent as staged)
                part = chains[0]
                with stage("sampling"):
                    probs = self._probs(part)
                verdicts = sampled_verdict(probs, part.draft.tokens, part.draft.probs, part.request.generator,
                                           sent[staged.tokens])
            elif self.sampled_p is not None:
                verdicts = staged.verdicts(self.sampled_p, [p.request.generator for p in chains], sent)
            else:
                return
        except Exception:  # told apart in take, request by request
            return
        self.on_device.append(verdicts.flatten())
        self.chain_at = {p.request.request_id: self.at + 2 * i for i, p in enumerate(chains)}
        self.at += 2 * len(chains)

    def verify_trees(self, trees: list[Part], staged: StagedTrees, sent: list[torch.Tensor]) -> None:
        """The sampled trees walked together (sampled_trees.py), their answer put in the read; where the
        probabilities were not made together or the walk fails, each tree is verified alone as it is taken (a
        failure there is its own)."""
        try:
            if self.sampled_p is not None:
                probs = self.sampled_p
            elif len(trees) == 1:  # the one sampled part: its own probabilities, its root at row 0 as staged
                with stage("sampling"):
                    probs = self._probs(trees[0])
            else:
                return
            tokens, going = staged.verdicts(probs, [p.request.generator for p in trees], sent)
        except Exception:  # told apart in take, request by request
            return
        self.on_device += [tokens.flatten(), going.flatten().long()]
        self.walked = WalkedTrees(self.at, staged, {p.request.request_id: i for i, p in enumerate(trees)})
        self.at += 2 * tokens.numel()

    def _probs(self, part: Part) -> torch.Tensor:
        rid, start, n = part.request.request_id, part.start, part.count
        if rid in self.probs:
            return self.probs[rid]
        return target_probs(sampleable(self.rows_of(rid, start, n), self.live[start:start + n]), part.request.params)

    def take(self, part: Part) -> None:
        """A request's part: by its sampling and draft, what it puts on the device for the read (a fault in it is
        the request's)."""
        req, draft, rid = part.request, part.draft, part.request.request_id
        try:
            if not req.params.greedy and req.params.seed is not None:
                with stage("sampling"):
                    self.seeded.append((part, self._probs(part)))
                self.later.append(part)
            elif req.params.greedy:
                self.later.append(part)
            elif self.walked is not None and rid in self.walked.columns:  # walked with the step's other trees
                self.later.append(part)
            elif draft.tree is not None:
                with stage("sampling"):
                    probs = self._probs(part)
                with stage("acceptance"):
                    self.out[rid] = accept_tree_sampled(probs, draft.tree, req.generator)
                self.later.append(part)
            elif rid in self.chain_at:  # verified with the step's other sampled chains
                self.later.append(part._replace(verdict_at=self.chain_at[rid]))
            else:
                with stage("sampling"):
                    probs = self._probs(part)
                with stage("acceptance"):
                    self.on_device.append(sampled_verdict(probs, draft.tokens, draft.probs, req.generator))
                self.later.append(part._replace(verdict_at=self.at))
                self.at += 2
        except Exception as exc:
            self.faults[rid] = fault_of(exc, rid, "sampling")

    def draw_seeded(self, staged: list[Part], places: torch.Tensor | None) -> None:
        """The seeded parts' tokens (Gumbel-max by their noise, seeded_draws), drawn together and put in the chosen
        tokens; where that pass fails, each part's alone (a failure there is its own: a fault, its rows left as
        they were, never read). staged: the seeded parts as the step staged them, and `places` their rows' places
        in the step's logits on the device (sent with the step's values): where every one of them was drawn."""
        if not self.seeded:
            return
        keys = [[(part.request.params.seed, pos) for pos in positions(part.request, part.draft, part.count)]
                for part, _ in self.seeded]
        try:
            drawn = list(zip(self.seeded, seeded_draws([probs for _, probs in self.seeded],
                                                        [key for mine in keys for key in mine])
                             .split([part.count for part, _ in self.seeded])))
        except Exception:  # told apart below, part by part
            drawn = []
            for (part, probs), mine in zip(self.seeded, keys):
                try:
                    with stage("sampling"):
                        drawn.append(((part, probs), seeded_draws([probs], mine)))
                except Exception as exc:
                    self.faults[part.request.request_id] = fault_of(exc, part.request.request_id, "sampling")
        if drawn:
            # the drawn parts are the staged ones in order, less any that faulted since: all of them, or a range each
            rows = places if places is not None and len(drawn) == len(staged) else \
                torch.cat([torch.arange(part.start, part.start + part.count, device=self.chosen.device)
                           for (part, _), _ in drawn])
            self.chosen = self.chosen.index_put((rows,), torch.cat([tokens for _, tokens in drawn]))

    def draw_plain(self) -> None:
        """The plain parts' tokens drawn in one batched call."""
        plain, rows_on_device = self.plain, self.plain_rows
        if not plain:
            return
        rows = self.logits[rows_on_device]
        for i, p in enumerate(plain):
            if p.request.request_id in self.reshaped:
                rows[i] = self.reshaped[p.request.request_id][1][0]
        rows = sampleable(rows, self.live[rows_on_device])
        try:
            probs = target_probs_rows(rows, self.plain_controls)  # each row bitwise its own alone
        except Exception:  # each row's made alone in draw_tokens (a failure there is its own)
            probs = None
        draws, failed = draw_tokens(rows, self.chosen[rows_on_device], [p.request.params for p in plain],
                                    [p.request.generator for p in plain], probs)
        self.on_device.append(draws)
        for i, exc in failed.items():  # (a part whose controls failed is drawn too, its first fault kept)
            self.faults.setdefault(plain[i].request.request_id, fault_of(exc, plain[i].request.request_id,
                                                                         "sampling"))

    def read(self) -> list[int]:
        """The step's one host read: chosen tokens, liveness, then verdicts and draws."""
        return torch.cat([self.chosen, self.live.long(), *self.on_device]).tolist()

    def verdicts(self, host: list[int], grammars: dict[str, RequestGrammar]) -> Verdicts:
        """Each part's new tokens from the read; a part whose tokens came from a dead row ends with a fault naming
        what left it empty."""
        r, faults = self.logits.shape[0], self.faults
        tokens = {p.request.request_id: [t] for p, t in zip(self.plain, host[self.at:])}
        for part in self.later:
            rid = part.request.request_id
            try:
                with stage("acceptance"):
                    tokens[rid] = self.out[rid] if rid in self.out else self.walked.tokens_of(rid, host) \
                        if self.walked is not None and rid in self.walked.columns else verdict_of(part, host)
            except Exception as exc:
                faults[rid] = fault_of(exc, rid, "acceptance")
        live = host[r:2 * r]
        for part in [*self.later, *self.plain] if 0 in live else ():  # a dead row is rare: one look for all
            rid = part.request.request_id
            # (row 0 is a row like any other: the test is against None)
            if rid in tokens and rid not in faults and \
                    (dead := first_dead_row(part, tokens[rid], live)) is not None:
                faults[rid] = no_token_fault(part.request, dead - part.start,
                                             bool(torch.isfinite(self.logits[dead].amax())), rid in grammars)
        for rid in faults:
            tokens.pop(rid, None)
        return Verdicts(tokens, faults)


def verdict_of(part: Part, host: list[int]) -> list[int]:
    """A request's new tokens from the step's host read: a sampled chain's verdict, else greedy verification of
    its draft (or none) against its chosen rows."""
    draft, start, n = part.draft, part.start, part.count
    if part.verdict_at is not None:  # a sampled chain: its accepted drafts, then the token drawn after them
        return list(draft.tokens[:host[part.verdict_at]]) + [host[part.verdict_at + 1]]
    if draft is not None and draft.tree is not None:
        return greedy_path(host[start:start + n], draft.tree)
    return greedy_run(host[start:start + n], draft.tokens if draft is not None else [])


def positions(req: Request, draft: Draft | None, n: int) -> list[int]:
    """The token positions a request's rows predict: row j of a chain the j-th token after the committed ones; in
    a tree, the root's row the next token and a node's row the token one deeper than the node."""
    if draft is not None and draft.tree is not None:
        return [req.num_tokens] + [req.num_tokens + d for d in draft.tree.depths()]
    return [req.num_tokens + j for j in range(n)]


def sampleable(rows: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """Rows a sampler can take: a dead row (see accept_drafts) as zeros. What is drawn from it is never used: the
    request whose output reaches that row ends there."""
    return torch.where(live[:, None], rows, torch.zeros((), dtype=rows.dtype, device=rows.device))


def first_dead_row(part: Part, new: list[int], live: list[int]) -> int | None:
    """The first row the request's new tokens came from that had no finite logit (None: all were live)."""
    path = part.draft.tree.follow(new[:-1]) if part.draft is not None and part.draft.tree is not None else None
    return next((part.start + j for j in rows_of_new_tokens(len(new), path) if not live[part.start + j]), None)


def no_token_fault(req: Request, offset: int, model_finite: bool, structured: bool) -> RequestFault:
    """The fault of a request whose output reached a row no token can be drawn from (offset: tokens after the
    committed ones), naming what left it empty: the model's own logits, or the request's controls."""
    at = req.num_output_tokens + offset
    if not model_finite:
        return RequestFault("sampling", f"the model's logits at output token {at} are not finite (NaN or inf)")
    p = req.params
    named = []
    if structured:
        named.append(p.structured.compiled[1] if p.structured.compiled else "structured_outputs")
    if p.min_tokens > at:
        named.append(f"min_tokens={p.min_tokens}")
    if p.logit_bias:
        named.append("logit_bias")
    if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1:
        named.append("penalties")
    what = ", ".join(named) or "the controls"
    return RequestFault("logits controls", f"no token can come at output token {at}: {what} leave every token's "
                                           f"logit at -inf")
