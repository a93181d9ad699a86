"""Accept: per request due a token, the tokens a verify step yields (accepted drafts + one from the target), by the
lossless rules of rejection_sampler.py; requests without drafts sample their one token in one batched call, and the
step's tokens come to the host in one read.

Seeded sampled requests take, at each position, the Gumbel-max token of noise keyed by (seed, position)
(runtime/sampler.seeded_tokens) and verify drafts against it as greedy requests verify against the argmax: their
output is seeded decoding's without speculation, whatever the proposers offered.

Each request's part runs on its own: what fails in it (its logits controls, its grammar, its sampling, its
acceptance) becomes that request's fault (types/faults.py), and a row with no finite logit is never sampled: the
request whose output reaches it ends with a fault that names its controls."""
from __future__ import annotations

from collections.abc import Collection
from typing import NamedTuple

import torch

from smartspec.runtime.logits_controls import ControlledRows, reshape_rows
from smartspec.runtime.model_runner import ForwardItem
from smartspec.runtime.sampler import draw_tokens, seeded_tokens, target_probs
from smartspec.runtime.upload import upload_lists
from smartspec.spec_decode.proposer import Draft
from smartspec.spec_decode.rejection_sampler import accept_tree_sampled, greedy_path, greedy_run, sampled_verdict
from smartspec.structured.matcher import RequestGrammar, apply_masks, empty_masks
from smartspec.types.faults import RequestFault, StageError, fault_of, stage
from smartspec.types.logprobs import rows_of_new_tokens
from smartspec.types.request import Request


class Verdicts(NamedTuple):
    """What the accept stage hands the commit stage."""
    tokens: dict[str, list[int]]  # request -> its new tokens (accepted drafts + the target's one)
    faults: dict[str, RequestFault]  # request -> why it ends in this step instead (its part of the step failed)


class _Rows(NamedTuple):
    """A request's logits rows in the step, and what reads them after the step's one host read."""
    request: Request
    draft: Draft | None
    start: int
    count: int
    verdict_at: int | None = None  # a sampled chain: where its [accepted, token] pair sits in the read


def accept_drafts(items: list[ForwardItem], logits: torch.Tensor, drafts: dict[str, Draft],
                  eos_token_ids: Collection[int] = (), grammars: dict[str, RequestGrammar] | None = None) -> Verdicts:
    """items: the step's forward items whose logits rows are `logits`, in order (an item with no rows yields no
    token); drafts: request -> its draft; grammars: structured requests' grammars at their committed tokens.

    Every row's chosen token (argmax, or a seeded request's), each sampled chain's verdict and the plain rows'
    draws stay on the logits' device and come to the host in one read for the step, with each row's liveness; only
    a sampled token tree reads once per level of its own (which children it tries at a level depends on the level
    above)."""
    faults: dict[str, RequestFault] = {}
    step = _StepRows(logits, controlled(items, logits, drafts, eos_token_ids, grammars or {}, faults), faults,
                     _sampled_chains(items, drafts, logits.device))
    row = 0
    for it in items:
        start, n = row, it.num_logits
        row += n
        if n and it.request.request_id not in faults:
            step.take(_Rows(it.request, drafts.get(it.request.request_id), start, n))
    step.draw_plain()
    return step.verdicts(step.read(), grammars or {})


class _StepRows:
    """A step's rows on their way to its one host read: each row's liveness and chosen token (argmax, a
    controlled request's from its reshaped rows, a seeded request's draw), the sampled chains' verdicts and the
    plain rows' draws; and what reads each request's part of the read."""

    def __init__(self, logits: torch.Tensor, reshaped: dict[str, tuple[int, torch.Tensor]],
                 faults: dict[str, RequestFault], chains: dict[str, torch.Tensor]) -> None:
        """chains: the sampled chains' draft tokens on the logits' device, by request (_sampled_chains)."""
        self.logits, self.reshaped, self.faults, self.chains = logits, reshaped, faults, chains
        self.live = torch.isfinite(logits.amax(dim=-1))  # False: a NaN, a +inf, or no finite logit at all
        self.chosen = logits.argmax(dim=-1)
        if reshaped:  # the controlled requests' rows: their own liveness and argmax, in their places
            at_rows = torch.cat([torch.arange(start, start + len(block), device=self.chosen.device)
                                 for start, block in reshaped.values()])
            blocks = torch.cat([block for _, block in reshaped.values()])
            self.live = self.live.index_put((at_rows,), torch.isfinite(blocks.amax(dim=-1)))
            self.chosen = self.chosen.index_put((at_rows,), blocks.argmax(dim=-1))
        self.seeded: list[tuple[int, torch.Tensor]] = []  # (first row, its tokens): seeded requests' draws
        self.on_device: list[torch.Tensor] = []  # what the read brings after chosen and live
        self.at = 2 * logits.shape[0]  # where the next of them sits in the read
        self.out: dict[str, list[int]] = {}  # sampled trees' tokens (they read on their own)
        self.later: list[_Rows] = []  # parts read from the step's read
        self.plain: list[_Rows] = []  # unseeded sampled parts without drafts: drawn together

    def rows_of(self, rid: str, start: int, n: int) -> torch.Tensor:
        """A request's logits rows as its sampling reads them: reshaped by its controls, else the model's."""
        return self.reshaped[rid][1] if rid in self.reshaped else self.logits[start:start + n]

    def _probs(self, part: _Rows) -> torch.Tensor:
        rid, start, n = part.request.request_id, part.start, part.count
        return target_probs(_sampleable(self.rows_of(rid, start, n), self.live[start:start + n]), part.request.params)

    def take(self, part: _Rows) -> None:
        """A request's part: by its sampling and draft, what it puts on the device for the read (a fault in it is
        the request's)."""
        req, draft, rid = part.request, part.draft, part.request.request_id
        try:
            if not req.params.greedy and req.params.seed is not None:
                with stage("sampling"):
                    probs = self._probs(part)
                    self.seeded.append((part.start, seeded_tokens(probs, req.params.seed,
                                                                  _positions(req, draft, part.count))))
                self.later.append(part)
            elif req.params.greedy:
                self.later.append(part)
            elif draft is None:
                self.plain.append(part)
            elif draft.tree is not None:
                with stage("sampling"):
                    probs = self._probs(part)
                with stage("acceptance"):
                    self.out[rid] = accept_tree_sampled(probs, draft.tree, req.generator)
                self.later.append(part)
            else:
                with stage("sampling"):
                    probs = self._probs(part)
                with stage("acceptance"):
                    self.on_device.append(sampled_verdict(probs, draft.tokens, draft.probs, req.generator,
                                                          self.chains.get(rid)))
                self.later.append(part._replace(verdict_at=self.at))
                self.at += 2
        except Exception as exc:
            self.faults[rid] = fault_of(exc, rid, "sampling")

    def draw_plain(self) -> None:
        """The seeded draws into the chosen tokens; the plain parts' tokens drawn in one batched call."""
        if self.seeded:
            rows = torch.cat([torch.arange(s, s + len(t), device=self.chosen.device) for s, t in self.seeded])
            self.chosen = self.chosen.index_put((rows,), torch.cat([t for _, t in self.seeded]))
        if not self.plain:
            return
        plain_rows = upload_lists([[p.start for p in self.plain]], self.logits.device)[0]
        rows = self.logits[plain_rows]
        for i, p in enumerate(self.plain):
            if p.request.request_id in self.reshaped:
                rows[i] = self.reshaped[p.request.request_id][1][0]
        draws, failed = draw_tokens(_sampleable(rows, self.live[plain_rows]), self.chosen[plain_rows],
                                    [p.request.params for p in self.plain], [p.request.generator for p in self.plain])
        self.on_device.append(draws)
        for i, exc in failed.items():
            self.faults[self.plain[i].request.request_id] = fault_of(exc, self.plain[i].request.request_id,
                                                                     "sampling")

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
                    tokens[rid] = self.out[rid] if rid in self.out else _verdict(part, host)
            except Exception as exc:
                faults[rid] = fault_of(exc, rid, "acceptance")
        for part in [*self.later, *self.plain]:
            rid = part.request.request_id
            if rid in tokens and rid not in faults and (dead := _first_dead_row(part, tokens[rid], host[r:2 * r])):
                faults[rid] = no_token_fault(part.request, dead - part.start,
                                             bool(torch.isfinite(self.logits[dead].amax())), rid in grammars)
        for rid in faults:
            tokens.pop(rid, None)
        return Verdicts(tokens, faults)


def _sampled_chains(items: list[ForwardItem], drafts: dict[str, Draft], device: torch.device) \
        -> dict[str, torch.Tensor]:
    """The draft tokens of the step's sampled (unseeded) chains, on the device in one copy, by request: what their
    verdicts compare the target's probabilities at."""
    chains = {}
    for it in items:
        req, draft = it.request, drafts.get(it.request.request_id)
        if (it.num_logits and draft is not None and draft.tree is None and draft.tokens and not req.params.greedy
                and req.params.seed is None):
            chains[req.request_id] = draft.tokens
    sent = upload_lists(list(chains.values()), device) if chains else []
    return dict(zip(chains, sent))


def _verdict(part: _Rows, host: list[int]) -> list[int]:
    """A request's new tokens from the step's host read: a sampled chain's verdict, else greedy verification of
    its draft (or none) against its chosen rows."""
    draft, start, n = part.draft, part.start, part.count
    if part.verdict_at is not None:  # a sampled chain: its accepted drafts, then the token drawn after them
        return list(draft.tokens[:host[part.verdict_at]]) + [host[part.verdict_at + 1]]
    if draft is not None and draft.tree is not None:
        return greedy_path(host[start:start + n], draft.tree)
    return greedy_run(host[start:start + n], draft.tokens if draft is not None else [])


def _positions(req: Request, draft: Draft | None, n: int) -> list[int]:
    """The token positions a request's rows predict: row j of a chain the j-th token after the committed ones; in
    a tree, the root's row the next token and a node's row the token one deeper than the node."""
    if draft is not None and draft.tree is not None:
        return [req.num_tokens] + [req.num_tokens + d for d in draft.tree.depths()]
    return [req.num_tokens + j for j in range(n)]


def _sampleable(rows: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """Rows a sampler can take: a dead row (see accept_drafts) as zeros. What is drawn from it is never used: the
    request whose output reaches that row ends there."""
    return torch.where(live[:, None], rows, torch.zeros((), dtype=rows.dtype, device=rows.device))


def _first_dead_row(part: _Rows, new: list[int], live: list[int]) -> int | None:
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


def controlled(items: list[ForwardItem], logits: torch.Tensor, drafts: dict[str, Draft],
               eos_token_ids: Collection[int], grammars: dict[str, RequestGrammar],
               faults: dict[str, RequestFault]) -> dict[str, tuple[int, torch.Tensor]]:
    """The rows of requests whose sampling controls or grammar read their history, reshaped and masked, by request:
    (its first row in logits, its rows [n, V] fp32). Row j of a chain after the first j draft tokens, a tree's node
    rows after the path to the node. Only these rows are copied (the step's logits stay the model's, as logprobs read
    them). A request whose controls or grammar fail is entered in faults (its rows are then never read)."""
    parts, row = [], 0
    for it in items:
        req, n = it.request, it.num_logits
        if n and (req.params.reshapes_logits or req.request_id in grammars):
            parts.append((req, row, _prefixes(drafts.get(req.request_id), n)))
        row += n
    if not parts:
        return {}
    rows = _reshaped(logits, parts, eos_token_ids, faults)
    if any(req.request_id in grammars for req, _, _ in parts):
        _masked(rows, parts, grammars, faults)
    blocks = rows.split([len(prefixes) for _, _, prefixes in parts])
    return {req.request_id: (start, block) for (req, start, _), block in zip(parts, blocks)
            if req.request_id not in faults}


def _prefixes(draft: Draft | None, n: int) -> list[list[int]]:
    """The draft tokens before each of a request's n rows."""
    if draft is None:
        return [[]]
    if draft.tree is not None:
        return [[]] + draft.tree.paths()
    return [draft.tokens[:j] for j in range(n)]


def _reshaped(logits: torch.Tensor, parts: list[tuple[Request, int, list[list[int]]]],
              eos_token_ids: Collection[int], faults: dict[str, RequestFault]) -> torch.Tensor:
    """The parts' rows copied out of the step's logits, one after another, and reshaped by their controls, all parts
    in one pass (reshape_rows: a request without controls comes out as copied). Where that pass fails, each part
    alone: the one whose controls fail is entered in faults (its rows are then copied as they were, never read),
    the others go on."""
    sizes = [len(prefixes) for _, _, prefixes in parts]
    rows = [ControlledRows(req.params, req.prompt_token_ids, req.output_token_ids, prefixes)
            for req, _, prefixes in parts]
    index = [i for (_, start, _), n in zip(parts, sizes) for i in range(start, start + n)]
    try:
        return reshape_rows(logits, rows, eos_token_ids, index)
    except Exception:  # told apart below, request by request
        pass
    blocks = []
    for (req, start, _), n, one in zip(parts, sizes, rows):
        block = logits[start:start + n]
        try:
            with stage("logits controls"):
                blocks.append(reshape_rows(block, [one], eos_token_ids))
        except Exception as exc:
            faults[req.request_id] = fault_of(exc, req.request_id, "logits controls")
            blocks.append(block.float())
    return torch.cat(blocks)


def _masked(rows: torch.Tensor, parts: list[tuple[Request, int, list[list[int]]]],
            grammars: dict[str, RequestGrammar], faults: dict[str, RequestFault]) -> None:
    """The structured parts' rows (in `rows`, the parts' rows one after another) masked in place by their grammars
    after each row's prefix: each grammar fills its rows of one bitmask (a failure is its request's fault), and the
    masks are unpacked and applied in one pass over every part's rows (apply_masks)."""
    vocab = next(grammars[req.request_id].vocab_size for req, _, _ in parts if req.request_id in grammars)
    bitmask = empty_masks(len(rows), vocab)
    valid, at = [], 0
    for req, _, prefixes in parts:
        grammar, rid = grammars.get(req.request_id), req.request_id
        ok = [False] * len(prefixes)
        if grammar is not None and rid not in faults:
            try:
                with stage("grammar"):
                    ok = grammar.fill_masks(prefixes, bitmask, at)
            except Exception as exc:
                faults[rid] = fault_of(exc, rid, "grammar")
        valid += ok
        at += len(prefixes)
    try:
        apply_masks(rows, bitmask, valid)
    except Exception as exc:  # the masks' own pass: each structured request's (its rows cannot be trusted)
        for req, _, _ in parts:
            if req.request_id in grammars and req.request_id not in faults:
                faults[req.request_id] = fault_of(StageError("grammar", exc), req.request_id, "grammar")
