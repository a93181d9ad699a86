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
from smartspec.sampling_params import SamplingParams

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
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._generator = torch.Generator(device=config.device).manual_seed(config.seed)
        self.num_steps = 0

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
        self.scheduler.remove(req)
        self._finish(req, "abort")
        return self._output(req, [], self._take_text(req))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step -------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch:
            return []
        items = [ForwardItem(s.request, s.request.token_ids[s.request.num_computed_tokens:
                                                           s.request.num_computed_tokens + s.num_tokens],
                             s.request.num_computed_tokens, 1 if s.completes else 0) for s in batch]
        logits = self.runner.forward(items)
        due = [it.request for it in items if it.num_logits]
        tokens = sample_tokens(logits, [r.params for r in due], [r.generator for r in due])
        for it in items:
            it.request.num_computed_tokens += len(it.tokens)
        outputs = [self._commit(req, [tok]) for req, tok in zip(due, tokens)]
        self.num_steps += 1
        return outputs

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
                self.scheduler.remove(req)
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
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.finish_time = time.monotonic()

    def _output(self, req: Request, added: list[int], new_text: str) -> RequestOutput:
        metrics = {"arrival_time": req.arrival_time, "first_token_time": req.first_token_time,
                   "finish_time": req.finish_time, "num_preemptions": req.num_preemptions}
        return RequestOutput(req.request_id, added, new_text, req.output_token_ids, req.text, req.finished,
                             req.finish_reason, req.num_prompt_tokens, metrics)
