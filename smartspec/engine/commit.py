"""Commit: a step's new tokens become part of their requests. The KV of accepted drafts is kept and the rest
dropped, the outcome is counted, tokens are appended (and detokenized, where there is a tokenizer) up to the first
stop, and a finished request gives back everything it held. The engine and the simulator both commit through here."""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from smartspec.engine.detokenizer import append_step_text, append_token_text, find_stop
from smartspec.engine.planner import Speculation
from smartspec.engine.scheduler import Scheduler
from smartspec.runtime.block_manager import BlockManager
from smartspec.spec_decode.hints import PREDICTION
from smartspec.structured.matcher import RequestGrammar
from smartspec.types.faults import stage
from smartspec.types.request import Request, RequestStatus


@dataclass
class Committed:
    added: list[int]  # the tokens appended (the step's new tokens up to a stop)
    finish_reason: str | None  # "stop", "length", or None while it runs on


@dataclass(frozen=True)
class TokenCommitter:
    """What committing reads of its engine: the KV blocks, the model's stop tokens, the context bound, and the
    tokenizer (None: no text; the simulator's token ids stand for lengths only)."""
    blocks: BlockManager
    stop_token_ids: Collection[int]
    max_model_len: int
    tokenizer: object | None = None

    def commit(self, req: Request, new: list[int], proposed: int, spec: Speculation, now: float,
               grammar: RequestGrammar | None = None, source: str | None = None) -> Committed:
        """new: the step's tokens for the request (accepted drafts + the target's one); proposed: its draft tokens,
        source: who drafted them (Draft.source; "prediction": its predicted output). grammar: a structured
        request's, advanced over the tokens taken; once it is complete the request stops. What fails in here
        escapes labelled by its stage (types/faults.py: commit, detokenizing, grammar); the step ends that request
        alone."""
        # keep the KV of the accepted drafts; rejected drafts' slots, and blocks reserved for drafts the proposer
        # did not make, go back
        with stage("commit"):
            self.blocks.truncate(req, req.num_tokens + len(new) - 1)
        req.spec.record(proposed, len(new) - 1, source)
        if source == PREDICTION:
            req.spec.record_prediction(proposed, len(new) - 1)
        spec.metrics.record(proposed, len(new) - 1, source)
        if req.first_token_time is None:
            req.first_token_time = now
        added, reason = self._append(req, new, grammar)
        if self.tokenizer is not None and not req.params.stop:  # text a step at a time (_append: a token at a time)
            with stage("detokenizing"):
                append_step_text(self.tokenizer, req, len(added))
        if reason is None:
            self.blocks.register(req)  # committed tokens are final: their full blocks can be shared
        return Committed(added, reason)

    def _append(self, req: Request, new: list[int], grammar: RequestGrammar | None) -> tuple[list[int], str | None]:
        """The tokens appended up to the first stop, and the finish reason it gave (None: the request runs on)."""
        each_text = self.tokenizer is not None and bool(req.params.stop)  # stop strings: in each token's text
        if grammar is None and not each_text:
            return self._append_counted(req, new)
        added, reason = [], None
        for tok in new:
            req.token_ids.append(tok)
            added.append(tok)
            delta = ""
            if each_text:
                with stage("detokenizing"):
                    delta = append_token_text(self.tokenizer, req)
            if tok in req.params.stop_token_ids or (not req.params.ignore_eos and tok in self.stop_token_ids):
                reason = "stop"
            elif req.num_output_tokens >= req.params.min_tokens and (cut := find_stop(req, delta)) is not None:
                req.text = req.text[:cut]
                reason = "stop"
            elif req.num_output_tokens >= req.params.max_tokens or req.num_tokens >= self.max_model_len:
                reason = "length"
            if grammar is not None and reason != "stop":
                with stage("grammar"):  # a token its masks allowed and it refuses: this request ends, the batch goes on
                    grammar.commit([tok])
                reason = "stop" if grammar.finished else reason
            if reason:
                break
        return added, reason

    def _append_counted(self, req: Request, new: list[int]) -> tuple[list[int], str | None]:
        """_append where only stop tokens and lengths can end the request (no stop strings, no grammar): the first
        token that does, found without a pass per token; a stop token before or at the length bound wins, as it
        does token by token."""
        params = req.params
        ends = params.stop_token_ids if params.ignore_eos else (*params.stop_token_ids, *self.stop_token_ids)
        stop = next((i for i, tok in enumerate(new) if tok in ends), None) if ends else None
        # the token that reaches max_tokens or the context (the first always goes in)
        bound = max(0, min(params.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens) - 1)
        if stop is not None and stop <= bound:
            added, reason = new[:stop + 1], "stop"
        elif bound < len(new):
            added, reason = new[:bound + 1], "length"
        else:
            added, reason = list(new), None
        req.token_ids.extend(added)
        return added, reason


def finish_request(req: Request, reason: str, scheduler: Scheduler, spec: Speculation, now: float) -> None:
    """End a request: its target and draft KV blocks go back, the proposer and the policy forget it. Its own state
    and its target blocks first: a proposer that fails to forget it (a dead draft actor) cannot keep it running."""
    req.status = RequestStatus.FINISHED
    req.finish_reason = reason
    req.finish_time = now
    scheduler.remove(req)
    if spec.proposer is not None:
        spec.proposer.finish(req)
        spec.proposer.release(req.request_id)
    spec.policy.release(req.request_id)
