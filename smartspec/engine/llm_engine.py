"""The step loop: schedule -> forward -> sample -> commit."""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

from smartspec.config import EngineConfig
from smartspec.engine.block_manager import BlockManager
from smartspec.engine.detokenizer import append_text, find_stop
from smartspec.engine.model_runner import ForwardItem, ModelRunner
from smartspec.engine.request import Request, RequestStatus
from smartspec.engine.sampler import sample_tokens
from smartspec.engine.scheduler import Scheduler
from smartspec.models import load_model
from smartspec.policy.base import OffPolicy, StepRecord, make_policy
from smartspec.sampling_params import SamplingParams
from smartspec.spec.metrics import SpecDecodeMetrics
from smartspec.spec.proposer import Proposal, Proposer
from smartspec.spec.rejection_sampler import accept

logger = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    token_ids: list[int]  # all output tokens so far
    text: str
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort"
    num_prompt_tokens: int
    metrics: dict = field(default_factory=dict)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        loaded = load_model(config.model, config.dtype, config.device)
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        self.stop_token_ids = loaded.stop_token_ids
        self.vocab_size = self.model.config.vocab_size
        if config.max_model_len and config.max_model_len > loaded.max_position_embeddings:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's context "
                             f"({loaded.max_position_embeddings} positions)")
        self.max_model_len = config.max_model_len or min(loaded.max_position_embeddings, 4096)
        per_block = ModelRunner.bytes_per_block(self.model, config.block_size)
        num_blocks = config.num_kv_blocks or int(config.kv_cache_gib * 2**30 // per_block)
        if num_blocks * config.block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache ({num_blocks} blocks x {config.block_size} tokens = "
                f"{num_blocks * config.block_size} tokens) cannot hold one request of max_model_len="
                f"{self.max_model_len} tokens; raise kv_cache_gib / num_kv_blocks or lower max_model_len")
        self.blocks = BlockManager(num_blocks, config.block_size)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(self.model, self.blocks, config.use_kernels, config.device)
        self.spec = config.speculative_config
        self.k_max = self.spec.num_speculative_tokens if self.spec else 0
        self.proposer: Proposer | None = self._make_proposer(num_blocks) if self.spec else None
        self.policy = make_policy(self.spec.policy, self.k_max) if self.spec else OffPolicy()
        self.spec_metrics = SpecDecodeMetrics()
        self.timing = {"steps": 0, "draft_s": 0.0, "verify_s": 0.0, "other_s": 0.0}
        self.last_step: StepRecord | None = None
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._generator = torch.Generator(device=config.device).manual_seed(config.seed)
        self.num_steps = 0

    def _make_proposer(self, num_blocks: int) -> Proposer:
        if self.spec.method == "ngram":
            from smartspec.spec.ngram import NgramProposer
            return NgramProposer(self.spec.prompt_lookup_max, self.spec.prompt_lookup_min)
        from smartspec.spec.draft_model import DraftModelProposer
        # the draft holds what the target holds, plus k drafts per running request
        extra = self.config.max_num_seqs * self.blocks.blocks_for(self.k_max + 1)
        return DraftModelProposer(self.spec.model, self.tokenizer, self.vocab_size, num_blocks + extra,
                                  self.config.block_size, self.config.use_kernels, self.config.dtype,
                                  self.config.device)

    def set_speculation(self, proposer: Proposer | None = None, policy=None, k_max: int | None = None) -> None:
        """Swap the proposer, the policy or K between runs (benchmarks compare configurations on one loaded
        target). Only while no request is in flight: a proposer holds per-request state."""
        if self.has_unfinished():
            raise RuntimeError("set_speculation needs an idle engine")
        if k_max is not None:
            self.k_max = k_max
        if proposer is not None:
            self.proposer = proposer
        if policy is not None:
            self.policy = make_policy(policy, self.k_max)

    # ---- requests -------------------------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return self.tokenizer(prompt).input_ids
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        return ids

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        ids = self.tokenize(prompt)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; the context holds {self.max_model_len} "
                             f"(max_model_len), leaving no room to generate")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        gen = None
        if not params.greedy:
            gen = (torch.Generator(device=self.config.device).manual_seed(params.seed)
                   if params.seed is not None else self._generator)
        req = Request(request_id, ids, params, gen)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self._finish(req, "abort")
        return self._output(req, [], self._take_text(req))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step -------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """schedule -> choose k -> propose -> verify -> accept -> commit."""
        t_start = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch:
            return []
        decoding = [s.request for s in batch if s.completes and s.num_tokens == 1]
        ks = self._choose_k(decoding, self.config.max_num_batched_tokens - sum(s.num_tokens for s in batch))
        t_draft = time.perf_counter()
        proposal = self._propose(decoding, ks)
        drafts = {r.request_id: (t, q) for r, t, q in zip(decoding, proposal.tokens, proposal.probs)}
        items = []
        for s in batch:
            req, c = s.request, s.request.num_computed_tokens
            draft = drafts.get(req.request_id, ((), None))[0]
            items.append(ForwardItem(req, req.token_ids[c:c + s.num_tokens] + list(draft), c,
                                     1 + len(draft) if s.completes else 0))
        t_verify = time.perf_counter()
        logits = self.runner.forward(items)
        t_accept = time.perf_counter()
        new_tokens = self._accept(items, logits, drafts)
        outputs = []
        for it in items:
            it.request.num_computed_tokens += len(it.tokens)
        for it in items:
            req = it.request
            if req.request_id not in new_tokens:
                continue
            new = new_tokens[req.request_id]
            proposed = len(drafts.get(req.request_id, ((), None))[0])
            if proposed:
                # keep the KV of the accepted drafts; the rejected ones' slots are simply reused
                self.blocks.truncate(req, req.num_tokens + len(new) - 1)
            req.spec.record(proposed, len(new) - 1)
            self.spec_metrics.record(proposed, len(new) - 1)
            outputs.append(self._commit(req, new))
            if self.proposer is not None and not req.finished:
                self.proposer.sync(req)
        t_end = time.perf_counter()
        self._record_step(batch, items, decoding, ks, proposal, new_tokens,
                          t_verify - t_draft, t_accept - t_verify, t_end - t_start)
        return outputs

    def _choose_k(self, decoding: list[Request], budget: int) -> list[int]:
        if self.proposer is None or not decoding:
            return [0] * len(decoding)
        ks = self.policy.choose(decoding, self.k_max)
        if len(ks) != len(decoding) or any(not isinstance(k, int) or not 0 <= k <= self.k_max for k in ks):
            raise RuntimeError(f"policy {self.policy.name!r} returned invalid k {ks!r} (K={self.k_max})")
        out = []
        for req, k in zip(decoding, ks):
            # no drafting past max_tokens or the context, nor past the step's token budget or the free blocks
            k = min(k, req.params.max_tokens - req.num_output_tokens - 1, self.max_model_len - req.num_tokens - 1,
                    budget)
            room = (len(req.block_table) + self.blocks.num_free) * self.blocks.block_size - req.num_tokens
            k = max(0, min(k, room))
            if k:
                self.blocks.allocate(req, req.num_tokens + k)
            budget -= k
            out.append(k)
        return out

    def _propose(self, decoding: list[Request], ks: list[int]) -> Proposal:
        empty = Proposal([[] for _ in decoding], [None] * len(decoding))
        if self.proposer is None or not any(ks):
            return empty
        try:
            return self.proposer.propose(decoding, ks)
        except Exception:  # a failed proposer costs speed, never a request
            logger.exception("proposer failed; this step runs without speculation")
            return empty

    def _accept(self, items: list[ForwardItem], logits, drafts) -> dict[str, list[int]]:
        """Per request due a token: the tokens this step yields (accepted drafts + one from the target)."""
        out, plain_rows, plain = {}, [], []
        row = 0
        for it in items:
            if not it.num_logits:
                continue
            req = it.request
            draft, q = drafts.get(req.request_id, ((), None))
            if draft:
                out[req.request_id] = accept(logits[row:row + it.num_logits], list(draft), q, req.params,
                                             req.generator)
            else:
                plain_rows.append(row)
                plain.append(req)
            row += it.num_logits
        if plain:
            tokens = sample_tokens(logits[plain_rows], [r.params for r in plain], [r.generator for r in plain])
            out.update((r.request_id, [t]) for r, t in zip(plain, tokens))
        return out

    def _record_step(self, batch, items, decoding, ks, proposal, new_tokens, draft_s, verify_s, total_s) -> None:
        self.num_steps += 1
        self.timing["steps"] += 1
        self.timing["draft_s"] += draft_s
        self.timing["verify_s"] += verify_s
        self.timing["other_s"] += total_s - draft_s - verify_s
        proposed = [len(t) for t in proposal.tokens]
        record = StepRecord(
            step=self.num_steps, batch_size=len(items), ks=list(ks), proposed=proposed,
            accepted=[len(new_tokens.get(r.request_id, [None])) - 1 if p else 0 for r, p in zip(decoding, proposed)],
            request_ids=[r.request_id for r in decoding],
            num_batched_tokens=sum(len(it.tokens) for it in items),
            num_prefill_tokens=sum(s.num_tokens for s in batch if not (s.completes and s.num_tokens == 1)),
            num_context_tokens=sum(it.start + len(it.tokens) for it in items),
            draft_s=draft_s, verify_s=verify_s, total_s=total_s)
        self.last_step = record
        self.policy.observe(record)

    def _commit(self, req: Request, tokens: list[int]) -> RequestOutput:
        """Append tokens to a request, ending it at the first stop (nothing past a stop is kept)."""
        now = time.monotonic()
        if req.first_token_time is None:
            req.first_token_time = now
        added = []
        for tok in tokens:
            req.token_ids.append(tok)
            added.append(tok)
            delta = append_text(self.tokenizer, req)
            reason = None
            if tok in req.params.stop_token_ids or (not req.params.ignore_eos and tok in self.stop_token_ids):
                reason = "stop"
            elif (cut := find_stop(req, delta)) is not None:
                req.text = req.text[:cut]
                reason = "stop"
            elif req.num_output_tokens >= req.params.max_tokens or req.num_tokens >= self.max_model_len:
                reason = "length"
            if reason:
                self.requests.pop(req.request_id, None)
                self._finish(req, reason)
                break
        return self._output(req, added, self._take_text(req))

    @staticmethod
    def _take_text(req: Request) -> str:
        """Text not streamed yet. While a request runs, the last (longest stop - 1) chars are held back: they
        may be the start of a stop string, which must never reach the client."""
        end = len(req.text)
        if not req.finished and req.params.stop:
            end = max(req.num_text_sent, end - max(map(len, req.params.stop)) + 1)
        new, req.num_text_sent = req.text[req.num_text_sent:end], end
        return new

    def _finish(self, req: Request, reason: str) -> None:
        """End a request: its target and draft KV blocks go back, the policy forgets it."""
        self.scheduler.remove(req)
        if self.proposer is not None:
            self.proposer.release(req.request_id)
        self.policy.release(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.finish_time = time.monotonic()

    def _output(self, req: Request, added: list[int], new_text: str) -> RequestOutput:
        metrics = {"arrival_time": req.arrival_time, "first_token_time": req.first_token_time,
                   "finish_time": req.finish_time, "num_preemptions": req.num_preemptions,
                   "spec_decode": req.spec.as_dict()}
        return RequestOutput(req.request_id, added, new_text, req.output_token_ids, req.text, req.finished,
                             req.finish_reason, req.num_prompt_tokens, metrics)
