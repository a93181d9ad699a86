"""The step loop: schedule -> forward -> sample -> commit."""
from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from smartspec.config import EngineConfig
from smartspec.engine.block_manager import BlockManager
from smartspec.engine.detokenizer import append_text, find_stop
from smartspec.engine.logprobs import TokenLogprob, rows_of_new_tokens, token_logprob
from smartspec.engine.model_runner import ForwardItem, ModelRunner
from smartspec.engine.page_arena import release_freed_memory
from smartspec.engine.request import Request, RequestStatus
from smartspec.engine.scheduler import Scheduler, split_batch
from smartspec.engine.step_record import StepRecord
from smartspec.engine.step_stats import StepStats
from smartspec.engine.trace import StepTraceWriter
from smartspec.models import load_model
from smartspec.models.loader import LoadedModel
from smartspec.policy import OffPolicy, Policy
from smartspec.sampling_params import SamplingParams
from smartspec.spec_decode.config import SpeculativeConfig
from smartspec.spec_decode.proposer import Proposer
from smartspec.spec_decode.speculator import Speculator
from smartspec.spec_decode.tree import TokenTree

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
    new_logprobs: list[TokenLogprob] | None = None  # of new_token_ids, when the request asked for logprobs
    prompt_logprobs: list[TokenLogprob | None] | None = None  # once the prompt is computed, when asked


# Hooks for where the parts run (the serving layer puts them in Ray actors); the defaults run them in-process.
RunnerFactory = Callable[[LoadedModel, BlockManager], "ModelRunner"]  # loaded without weights -> a runner
ProposerFactory = Callable[[SpeculativeConfig, "LLMEngine", int], Proposer]  # (spec, engine, draft KV blocks)


class LLMEngine:
    def __init__(self, config: EngineConfig, runner_factory: RunnerFactory | None = None,
                 proposer_factory: ProposerFactory | None = None) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        loaded = load_model(config.model, config.dtype, config.device, weights=runner_factory is None,
                            quantization=config.quantization)
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        self.stop_token_ids = loaded.stop_token_ids
        self.vocab_size = loaded.config.vocab_size
        if config.max_model_len and config.max_model_len > loaded.max_position_embeddings:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's context "
                             f"({loaded.max_position_embeddings} positions)")
        self.max_model_len = config.max_model_len or min(loaded.max_position_embeddings, 4096)
        per_block = ModelRunner.bytes_per_block(loaded.config, getattr(torch, config.dtype), config.block_size)
        num_blocks = config.num_kv_blocks or int(config.kv_cache_gib * 2**30 // per_block)
        if num_blocks * config.block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache ({num_blocks} blocks x {config.block_size} tokens = "
                f"{num_blocks * config.block_size} tokens) cannot hold one request of max_model_len="
                f"{self.max_model_len} tokens; raise kv_cache_gib / num_kv_blocks or lower max_model_len")
        self.blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = (runner_factory(loaded, self.blocks) if runner_factory is not None
                       else ModelRunner(self.model, self.blocks, config.use_kernels, config.device))
        spec = config.speculative_config
        proposer = None
        if spec:
            # the draft holds what the target holds, plus k drafts per running request
            # (a tree's draft also holds the nodes it fed: branching per depth)
            per_seq = max(spec.k_max, spec.tree.branching * (spec.tree.max_depth - 1) if spec.tree else 0) + 1
            draft_blocks = num_blocks + config.max_num_seqs * self.blocks.blocks_for(per_seq)
            proposer = (proposer_factory or make_proposer)(spec, self, draft_blocks)
        self.speculator = (Speculator(proposer, spec.make_policy(), spec.k_max) if spec
                           else Speculator(None, OffPolicy(), 0))
        self.trace = StepTraceWriter(config.trace_path, self.speculator.policy.name) if config.trace_path else None
        self.last_step: StepRecord | None = None
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._generator = torch.Generator(device=config.device).manual_seed(config.seed)
        self.num_steps = 0
        self.stats = StepStats()
        if config.warmup_profile and self.speculator.policy.wants_profile:
            self.profile_steps()
        release_freed_memory()  # what loading and warm-up freed, off the main thread too

    def set_speculation(self, proposer: Proposer | None = None, policy: Policy | None = None,
                        k_max: int | None = None) -> None:
        """Swap the proposer, the policy or K between runs (benchmarks compare configurations on one loaded
        target); what is not given stays. Only while no request is in flight: a proposer holds per-request state.
        The policy is an instance (`make_policy` or `SpeculativeConfig.make_policy` builds one from a name)."""
        if self.has_unfinished():
            raise RuntimeError("set_speculation needs an idle engine")
        if policy is not None and not isinstance(policy, Policy):
            raise TypeError(f"policy must be a Policy instance, got {type(policy).__name__}")
        sp = self.speculator
        self.speculator = Speculator(proposer or sp.proposer, policy or sp.policy,
                                     sp.k_max if k_max is None else k_max)

    def profile_steps(self, batches=(1, 4), context: int = 64) -> list[StepRecord]:
        """Measure a few step shapes and hand them to the policy's cost model (see engine/profile.py)."""
        from smartspec.engine.profile import profile_steps
        return profile_steps(self, batches, context)

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()
        for part in (self.runner, self.speculator.proposer):
            if hasattr(part, "close"):
                part.close()

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
        decoding, prefill = split_batch(batch)
        spec = self.speculator
        ks = spec.choose(decoding, self.config.max_num_batched_tokens - sum(s.num_tokens for s in batch),
                         self.blocks, self.max_model_len, prefill=prefill)
        t_draft = time.perf_counter()
        drafts = spec.propose(decoding, ks)
        items = []
        for s in batch:
            req, c = s.request, s.request.num_computed_tokens
            draft = drafts.get(req.request_id)
            if draft is not None and draft.tree is not None:
                items.append(tree_item(req, draft.tree))
                continue
            tokens = draft.tokens if draft is not None else []
            num_logits = 1 + len(tokens) if s.completes else 0
            if req.prompt_logprobs is not None and c < req.num_prompt_tokens:
                num_logits = s.num_tokens  # every position's row, for the prompt's logprobs
            items.append(ForwardItem(req, req.token_ids[c:c + s.num_tokens] + list(tokens), c, num_logits))
        t_verify = time.perf_counter()
        logits = self.runner.forward(items)
        t_accept = time.perf_counter()
        logits, sampled = self._take_prompt_logprobs(items, logits)
        new_tokens = spec.accept(sampled, logits, drafts)
        first_row, row = {}, 0
        for it in sampled:
            first_row[it.request.request_id], row = row, row + it.num_logits
        for it in items:
            it.request.num_computed_tokens += len(it.tokens)
        outputs, trees = [], {}  # trees: request -> (its tree, the accepted path), for the policy
        for it in items:
            req = it.request
            if req.request_id not in new_tokens:
                continue
            new = new_tokens[req.request_id]
            draft = drafts.get(req.request_id)
            proposed = len(draft.tokens) if draft is not None else 0
            path = None
            if draft is not None and draft.tree is not None:
                path = draft.tree.follow(new[:-1])
                trees[req.request_id] = (draft.tree, path)
                self._keep_path(it, path)
            logprobs = None
            if req.params.logprobs is not None:
                rows = rows_of_new_tokens(len(new), path)
                logprobs = [token_logprob(logits[first_row[req.request_id] + r], tok, req.params.logprobs)
                            for r, tok in zip(rows, new)]
            # keep the KV of the accepted drafts; rejected drafts' slots, and blocks reserved for drafts the
            # proposer did not make, go back
            self.blocks.truncate(req, req.num_tokens + len(new) - 1)
            spec.record(req, proposed, len(new) - 1)
            outputs.append(self._commit(req, new, logprobs))
            if not req.finished:
                self.blocks.register(req)  # committed tokens are final: their full blocks can be shared
            spec.sync(req)
        t_end = time.perf_counter()
        self._record_step(items, decoding, sum(s.num_tokens for s in prefill), ks, drafts, new_tokens, trees,
                          t_verify - t_draft, t_accept - t_verify, t_end - t_start)
        return outputs

    def _take_prompt_logprobs(self, items: list[ForwardItem], logits: torch.Tensor) \
            -> tuple[torch.Tensor, list[ForwardItem]]:
        """Record the prompt logprobs of chunks that computed every position's row; hand on the rows (and items)
        that sampling needs: a chunk's last row, when it completes its prompt, predicts the first new token."""
        if all(it.request.prompt_logprobs is None for it in items):
            return logits, items
        keep, sampled, row = [], [], 0
        for it in items:
            req = it.request
            if req.prompt_logprobs is not None and it.num_logits == len(it.tokens) and len(it.tokens) \
                    and it.start < req.num_prompt_tokens:
                completes = it.start + len(it.tokens) == req.num_tokens
                for j in range(it.num_logits - completes):
                    pos = it.start + j + 1
                    if pos < req.num_prompt_tokens and req.prompt_logprobs[pos] is None:
                        req.prompt_logprobs[pos] = token_logprob(logits[row + j], req.token_ids[pos],
                                                                 req.params.prompt_logprobs)
                it_sampled = replace(it, num_logits=int(completes))
            else:
                it_sampled = it
            keep.extend(range(row + it.num_logits - it_sampled.num_logits, row + it.num_logits))
            sampled.append(it_sampled)
            row += it.num_logits
        return logits[keep], sampled

    def _keep_path(self, item: ForwardItem, path: list[int]) -> None:
        """A token tree's accepted nodes move next to the context, so the cache is the committed sequence."""
        src = [item.start + 1 + node for node in path]
        dst = [item.start + 1 + depth for depth in range(len(path))]
        if src != dst:
            self.runner.copy_kv([self.blocks.slot(item.request, p) for p in src],
                                [self.blocks.slot(item.request, p) for p in dst])

    def _record_step(self, items, decoding, num_prefill, ks, drafts, new_tokens, trees, draft_s, verify_s,
                     total_s) -> None:
        self.num_steps += 1
        proposed = [len(drafts[r.request_id].tokens) if r.request_id in drafts else 0 for r in decoding]
        record = StepRecord(
            step=self.num_steps, batch_size=len(items), ks=list(ks), proposed=proposed,
            accepted=[len(new_tokens.get(r.request_id, [None])) - 1 if p else 0 for r, p in zip(decoding, proposed)],
            request_ids=[r.request_id for r in decoding],
            num_batched_tokens=sum(len(it.tokens) for it in items),
            num_prefill_tokens=num_prefill,
            num_context_tokens=sum(it.start + len(it.tokens) for it in items),
            draft_s=draft_s, verify_s=verify_s, total_s=total_s,
            predicted_s=self.speculator.policy.last_prediction if decoding else None,
            draft_catchup_tokens=self.speculator.proposer.last_catchup_tokens if drafts else 0,
            extra=self._record_extra(decoding, trees))
        self.last_step = record
        self.stats.add(record, sum(len(t) for t in new_tokens.values()))
        self.speculator.policy.observe(record)
        if self.trace is not None:
            self.trace.add(record)

    def _record_extra(self, decoding: list[Request], trees: dict) -> dict:
        """What the policy learns from beyond the counts: verified trees with their accepted paths, and which
        proposer each request drew where the policy chose them."""
        extra = {"trees": trees} if trees else {}
        methods = self.speculator.methods
        if methods is not None:
            extra["methods"] = {r.request_id: m for r, m in zip(decoding, methods)}
        return extra

    def _commit(self, req: Request, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
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
        if logprobs is not None:
            req.logprobs.extend(logprobs[:len(added)])
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
        self.speculator.release(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.finish_time = time.monotonic()

    def _output(self, req: Request, added: list[int], new_text: str) -> RequestOutput:
        metrics = {"arrival_time": req.arrival_time, "first_token_time": req.first_token_time,
                   "finish_time": req.finish_time, "num_preemptions": req.num_preemptions,
                   "spec_decode": req.spec.as_dict()}
        new_logprobs = req.logprobs[len(req.logprobs) - len(added):] if req.params.logprobs is not None else None
        return RequestOutput(req.request_id, added, new_text, req.output_token_ids, req.text, req.finished,
                             req.finish_reason, req.num_prompt_tokens, metrics, new_logprobs, req.prompt_logprobs)


def tree_item(req: Request, tree: TokenTree) -> ForwardItem:
    """A decoding request's root (its last token) and tree nodes: stored side by side, each node at its depth."""
    c = req.num_computed_tokens
    return ForwardItem(req, [req.token_ids[c]] + tree.tokens, c, 1 + len(tree),
                       positions=[c] + [c + d for d in tree.depths()], tree_base=c, tree_masks=tree.ancestor_masks())


def make_proposer(spec: SpeculativeConfig, engine: LLMEngine, num_blocks: int) -> Proposer:
    """The proposer a speculative config names, in-process, for the engine's target (the draft's cache: num_blocks)."""
    if spec.methods:  # several proposers, chosen per request
        from smartspec.spec_decode.mixed import MixedProposer
        return MixedProposer(make_proposer(spec.single("draft_model"), engine, num_blocks),
                             make_proposer(spec.single("suffix"), engine, num_blocks))
    if spec.method == "suffix":
        from smartspec.spec_decode.suffix import SuffixProposer
        return SuffixProposer(spec.tree.max_depth if spec.tree else spec.num_speculative_tokens,
                              spec.tree.branching if spec.tree else 1, spec.suffix_cache_tokens)
    if spec.method == "ngram":
        from smartspec.spec_decode.ngram import NgramProposer, NgramTreeProposer
        if spec.tree:
            return NgramTreeProposer(spec.tree.max_depth, spec.tree.branching, spec.prompt_lookup_max,
                                     spec.prompt_lookup_min)
        return NgramProposer(spec.prompt_lookup_max, spec.prompt_lookup_min)
    c = engine.config
    args = (spec.model, engine.tokenizer, engine.vocab_size, num_blocks, c.block_size, c.use_kernels, c.dtype,
            c.device, c.quantization, c.enable_prefix_caching)
    if spec.tree:
        from smartspec.spec_decode.draft_tree import DraftTreeProposer
        return DraftTreeProposer(*args, max_depth=spec.tree.max_depth, branching=spec.tree.branching)
    from smartspec.spec_decode.draft_model import DraftModelProposer
    return DraftModelProposer(*args)
