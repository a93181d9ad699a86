"""The accept stage's controlled rows: the rows of requests whose sampling controls or grammar read their history,
reshaped by their controls and masked by their grammars. Row j of a chain after the first j draft tokens, a tree's
node rows after the path to the node. Only these rows are copied (the step's logits stay the model's, as logprobs
read them).

In two halves around the step's one copy of host values (runtime/upload.py HostBatch): on the host, the controls'
values gathered and each grammar's masks filled, staged in the step's batch; on the device, once it is sent, the
rows reshaped and masked. A request whose controls or grammar fail is entered in the faults (its rows are then
never read)."""
from __future__ import annotations

from collections.abc import Collection
from typing import NamedTuple

import torch

from smartspec.runtime.logits_controls import ControlledRows, StagedControls, reshape_rows, reshape_staged
from smartspec.runtime.model_runner import ForwardItem
from smartspec.runtime.token_counts import TokenCounts
from smartspec.runtime.upload import HostBatch
from smartspec.spec_decode.proposer import Draft
from smartspec.structured.matcher import RequestGrammar, StagedMasks, apply_staged_masks, empty_masks
from smartspec.types.faults import RequestFault, StageError, fault_of, stage
from smartspec.types.request import Request

_Part = tuple[Request, int, list[list[int]]]  # a request, its first row in the step's logits, its rows' prefixes


class Reshaped(NamedTuple):
    """The controlled rows once reshaped and masked: by request, (its first row in the step's logits, its rows
    [n, V] fp32), a request with a fault left out; and every part's rows together (faulted ones too, never read)
    with their places in the step's logits, on the device (None where their staging failed)."""
    by_request: dict[str, tuple[int, torch.Tensor]]
    rows: torch.Tensor | None
    places: torch.Tensor | None


class ControlledParts:
    """The step's controlled requests, staged on the host (`__init__`), reshaped and masked once sent (`rows`)."""

    def __init__(self, items: list[ForwardItem], logits: torch.Tensor, drafts: dict[str, Draft],
                 eos_token_ids: Collection[int], grammars: dict[str, RequestGrammar],
                 faults: dict[str, RequestFault], batch: HostBatch, counts: TokenCounts | None = None) -> None:
        """logits: the step's, read here for their width and device only (their rows once sent: `rows`); counts:
        the penalized requests' histories kept between steps (None: each counted whole this step)."""
        self.parts: list[_Part] = []
        row = 0
        for it in items:
            req, n = it.request, it.num_logits
            if n and (req.params.reshapes_logits or req.request_id in grammars):
                self.parts.append((req, row, _prefixes(drafts.get(req.request_id), n)))
            row += n
        self.eos_token_ids, self.grammars = eos_token_ids, grammars
        self.controls = [ControlledRows(req.params, req.prompt_token_ids, req.output_tokens(), prefixes,
                                        req.request_id) for req, _, prefixes in self.parts]
        index = [i for _, start, prefixes in self.parts for i in range(start, start + len(prefixes))]
        try:
            self.staged: StagedControls | None = StagedControls(self.controls, eos_token_ids, logits.shape[1], index,
                                                                batch, logits.device, counts) \
                if self.parts else None
        except Exception:  # told apart once sent, request by request (_reshaped)
            self.staged = None
        self.masks = _staged_masks(self.parts, grammars, faults, batch) \
            if any(req.request_id in grammars for req, _, _ in self.parts) else None

    def rows(self, logits: torch.Tensor, sent: list[torch.Tensor], faults: dict[str, RequestFault]) -> Reshaped:
        """The parts' rows reshaped and masked (Reshaped); `sent`: the step's batch on the device."""
        if not self.parts:
            return Reshaped({}, None, None)
        rows = self._reshaped(logits, sent, faults)
        if self.masks is not None:
            try:
                apply_staged_masks(rows, self.masks, sent)
            except Exception as exc:  # the masks' own pass: each structured request's (its rows cannot be trusted)
                for req, _, _ in self.parts:
                    if req.request_id in self.grammars and req.request_id not in faults:
                        faults[req.request_id] = fault_of(StageError("grammar", exc), req.request_id, "grammar")
        blocks = rows.split([len(prefixes) for _, _, prefixes in self.parts])
        return Reshaped({req.request_id: (start, block) for (req, start, _), block in zip(self.parts, blocks)
                         if req.request_id not in faults},
                        rows, None if self.staged is None else sent[self.staged.ints[0]])

    def _reshaped(self, logits: torch.Tensor, sent: list[torch.Tensor],
                  faults: dict[str, RequestFault]) -> torch.Tensor:
        """The parts' rows copied out of the step's logits, one after another, and reshaped by their controls, all
        parts in one pass (a request without controls comes out as copied). Where that pass fails (or its staging
        did), each part alone, with a copy of its own: the one whose controls fail is entered in faults (its rows
        are then copied as they were, never read), the others go on."""
        if self.staged is not None:
            try:
                return reshape_staged(logits, self.staged, sent)
            except Exception:  # told apart below, request by request
                pass
        blocks = []
        for (req, start, prefixes), one in zip(self.parts, self.controls):
            block = logits[start:start + len(prefixes)]
            try:
                with stage("logits controls"):
                    blocks.append(reshape_rows(block, [one], self.eos_token_ids))
            except Exception as exc:
                faults[req.request_id] = fault_of(exc, req.request_id, "logits controls")
                blocks.append(block.float())
        return torch.cat(blocks)


def _prefixes(draft: Draft | None, n: int) -> list[list[int]]:
    """The draft tokens before each of a request's n rows."""
    if draft is None:
        return [[]]
    if draft.tree is not None:
        return [[]] + draft.tree.paths()
    return [draft.tokens[:j] for j in range(n)]


def _staged_masks(parts: list[_Part], grammars: dict[str, RequestGrammar], faults: dict[str, RequestFault],
                  batch: HostBatch) -> StagedMasks | None:
    """The structured parts' masks, one bitmask over every part's rows (in the parts' order): each grammar fills
    its rows after each row's prefix (a failure is its request's fault), staged in the batch to be applied in one
    pass once sent (None: no row has a valid prefix)."""
    vocab = next(grammars[req.request_id].vocab_size for req, _, _ in parts if req.request_id in grammars)
    bitmask = empty_masks(sum(len(prefixes) for _, _, prefixes in parts), vocab)
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
    return StagedMasks.of(bitmask, valid, batch)
