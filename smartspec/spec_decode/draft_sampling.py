"""The draft model's sampled rows, depth by depth, made together: at each depth of a proposal, the draft
distributions of every sampled request still drafting come from one target_probs_rows pass (each row its own
request's controls, bitwise target_probs of that row alone), not one target_probs a request. Their controls and
each depth's rows are staged once a proposal, sent in one copy after its first forward."""
from __future__ import annotations

from typing import NamedTuple

import torch

from smartspec.runtime.sampler import RowControls, StagedRowControls, target_probs_rows
from smartspec.runtime.upload import HostBatch
from smartspec.types.request import Request


class _Depth(NamedTuple):
    rows: list[int]  # the sampled requests' rows in the depth's forward
    rows_key: int  # and their key in the sent batch
    chosen: list[int] | None  # which of the proposal's sampled requests they are (None: all of them)
    chosen_key: int | None


class DraftSampling:
    """live: the proposal's first depth's (request index, draft state, k) entries; a request drafts at depth d
    while k > d, and the depth's rows are its live entries in order. Below two sampled requests at a depth,
    nothing is made together there (`probs` answers none): one request's own target_probs takes fewer operations."""

    def __init__(self, live: list[tuple[int, Request, int]], requests: list[Request], vocab: int,
                 device: torch.device) -> None:
        sampled = [(i, k) for i, _, k in live if not requests[i].params.greedy]
        self.depths: list[_Depth] = []
        if len(sampled) < 2:
            return
        batch = HostBatch()
        staged = StagedRowControls([requests[i].params for i, _ in sampled], vocab, batch)
        for depth in range(max(k for _, k in sampled)):
            row_of = {i: row for row, i in enumerate(i for i, _, k in live if k > depth)}
            chosen = [s for s, (_, k) in enumerate(sampled) if k > depth]
            if len(chosen) < 2:
                break
            rows = [row_of[sampled[s][0]] for s in chosen]
            every = len(chosen) == len(sampled)
            self.depths.append(_Depth(rows, batch.ints(rows), None if every else chosen,
                                      None if every else batch.ints(chosen)))
        self.sent = batch.send(device)
        self.controls = staged.on(self.sent)

    def probs(self, depth: int, logits: torch.Tensor, reshaped: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """The depth's sampled rows' draft distributions, by row of `logits` (the depth's forward); reshaped: the
        controlled rows, reshaped by their requests' controls, by row. Empty where fewer than two are sampled."""
        if depth >= len(self.depths):
            return {}
        at = self.depths[depth]
        rows = logits[self.sent[at.rows_key]].float()
        for j, row in enumerate(at.rows):
            if row in reshaped:
                rows[j] = reshaped[row]
        controls = self.controls if at.chosen is None else _chosen(self.controls, at.chosen, self.sent[at.chosen_key])
        return dict(zip(at.rows, target_probs_rows(rows, controls)))


def _chosen(controls: RowControls, chosen: list[int], index: torch.Tensor) -> RowControls:
    """The controls of some of the rows: `chosen`, and `index`, the same on the device."""
    def pick(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[index]
    return controls._replace(params=[controls.params[s] for s in chosen], temperature=pick(controls.temperature),
                             log_min_p=pick(controls.log_min_p), top_k=pick(controls.top_k), top_p=pick(controls.top_p))
