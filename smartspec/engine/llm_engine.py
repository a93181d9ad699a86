"""The step loop: schedule -> plan -> propose -> verify -> accept -> commit -> observe (the policy observes a step
beside the next step's forward: engine/step_observer.py).

Each stage is a call whose inputs and outputs are in its signature: the scheduler's batch, the policy's `SpecPlan`
(engine/planner.py), the proposer's `Drafted` (engine/drafter.py), the runner's logits, the accepted tokens
(spec_decode/accept.py), the commits (engine/commit.py) and the step's `StepRecord`, which the policy observes."""
from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

import torch

from smartspec.config import EngineConfig
from smartspec.engine.commit import TokenCommitter, finish_request
from smartspec.engine.drafter import Drafted, cut_to_grammars, propose
from smartspec.engine.outputs import RequestOutput, output_of, take_prompt_logprobs, take_text
from smartspec.engine.planner import DraftRoom, Speculation, plan_step
from smartspec.engine.profile_cache import KeptProfile, KeptProfileCheck, load_profile, profile_path, save_profile
from smartspec.engine.scheduler import ScheduledRequest, Scheduler, split_batch
from smartspec.engine.step_logprobs import logprobs_of, step_logprobs
from smartspec.engine.start_phases import StartPhases
from smartspec.engine.step_observer import StepObserver
from smartspec.engine.trace import StepTraceWriter
from smartspec.models import load_model
from smartspec.models.loader import LoadedModel
from smartspec.policy import Policy
from smartspec.runtime.block_manager import BlockManager
from smartspec.runtime.graph_buckets import BucketLimits
from smartspec.runtime.model_runner import ForwardItem, ModelRunner
from smartspec.runtime.page_arena import release_freed_memory
from smartspec.runtime.token_counts import TokenCounts
from smartspec.spec_decode.accept import Verdicts, accept_drafts
from smartspec.spec_decode.config import SpeculativeConfig
from smartspec.spec_decode.factory import DraftFactory, DraftRuntime, draft_blocks, make_draft_proposer, make_proposer
from smartspec.spec_decode.hints import RequestHints
from smartspec.spec_decode.proposer import Draft, Proposer
from smartspec.structured.compile import compiled
from smartspec.structured.feasible import refuse_impossible
from smartspec.structured.matcher import GrammarCompiler, RequestGrammar
from smartspec.types.faults import RequestFault, fault_of, stage
from smartspec.types.logprobs import TokenLogprob
from smartspec.types.plan import SpecPlan, StepView, fed_context
from smartspec.types.request import Request
from smartspec.types.sampling_params import ParamError, SamplingParams
from smartspec.types.snapshot import DraftHealth, EngineSnapshot, LoadCosts, StepTotals
from smartspec.types.step_record import StepRecord, VerifiedTree
from smartspec.types.tree import TokenTree

logger = logging.getLogger(__name__)


class StepResult(NamedTuple):
    outputs: list[RequestOutput]
    record: StepRecord | None  # None: nothing was scheduled
    generated: int  # tokens the step yielded (before stops cut them)
    plan_s: float = 0.0  # host seconds the policy's plan took, its view included (engine/planner.py plan_step)
    beside_s: float = 0.0  # host seconds of the work run beside the forward (run_step's beside_forward)


class StepTimes(NamedTuple):
    """A step's seconds: proposing, the target's forward, and all of it (schedule to commit)."""
    draft_s: float
    verify_s: float
    total_s: float


class PlannedStep(NamedTuple):
    """What a step planned, for its record: the decoding requests and their lengths as planned (before the step
    commits tokens), the plan, and the drafts the forward verified."""
    decoding: list[Request]
    lengths: list[int]
    plan: SpecPlan
    drafted: Drafted


# Where the target runs (the serving layer puts tensor-parallel shards in Ray actors); default: in-process.
RunnerFactory = Callable[[LoadedModel, BlockManager], ModelRunner]  # loaded without weights -> a runner


class LLMEngine:
    def __init__(self, config: EngineConfig, runner_factory: RunnerFactory | None = None,
                 draft_factory: DraftFactory = make_draft_proposer) -> None:
        """draft_factory: builds the draft model's proposer (in-process by default; the serving replica runs it in
        a Ray actor)."""
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        phases = StartPhases("engine")
        with phases.phase("load target"):
            loaded = load_model(config.model, config.dtype, config.device, weights=runner_factory is None,
                                quantization=config.quantization)
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        self.stop_token_ids = loaded.stop_token_ids
        self.vocab_size = loaded.config.vocab_size
        if config.max_model_len and config.max_model_len > loaded.max_position_embeddings:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's context "
                             f"({loaded.max_position_embeddings} positions)")
        self.max_model_len = config.max_model_len or min(loaded.max_position_embeddings, 4096)
        num_blocks = self._num_kv_blocks(loaded)
        self.blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens)
        self.committer = TokenCommitter(self.blocks, self.stop_token_ids, self.max_model_len, self.tokenizer)
        with phases.phase("model runner"):
            self.runner = (runner_factory(loaded, self.blocks) if runner_factory is not None
                           else ModelRunner(self.model, self.blocks, config.use_kernels, config.device,
                                            step_graphs="cuda" if config.cuda_graphs else "off",
                                            bucket_limits=self.bucket_limits()))
        spec = config.speculative_config
        with phases.phase("proposer"):
            self.speculation = self._start_speculation(num_blocks, draft_factory)
        self.trace = (StepTraceWriter(config.trace_path, self.speculation.policy.name) if config.trace_path
                      else None)
        self.last_step: StepRecord | None = None  # the last step run, for callers that inspect steps
        self.observer = StepObserver(plans_ahead=torch.device(config.device).type != "cpu")  # (step_observer.py)
        self.requests: dict[str, Request] = {}
        # structured outputs: each such request's grammar, at its committed tokens
        self.grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.stop_token_ids)
        self.grammars: dict[str, RequestGrammar] = {}
        self.hints = RequestHints()  # predicted outputs; each step, the drafts requests carry
        self.token_counts = TokenCounts()  # penalized requests' histories, counted on the device between steps
        self.request_hints = spec.request_hints if spec else False
        self._ids, self._generator = itertools.count(), torch.Generator(device=config.device).manual_seed(config.seed)
        self.num_steps, self.stats = 0, StepTotals()
        self.kept_check: KeptProfileCheck | None = None  # a kept profile, held against the first steps
        self.profile_due = False  # the kept profile was stale: measure it when idle (measure_profile_if_due)
        if config.warmup_profile and self.speculation.policy.wants_profile:
            with phases.phase("warm-up profile"):
                self.warm_up_profile()
        release_freed_memory()  # what loading and warm-up freed, off the main thread too
        phases.done()

    def _start_speculation(self, num_blocks: int, draft_factory: DraftFactory) -> Speculation:
        """The configured proposer (a draft model with its KV blocks, lookups) and policy; off without a config."""
        spec, config = self.config.speculative_config, self.config
        if not spec:
            return Speculation.off()
        runtime = self.draft_runtime(draft_blocks(spec, num_blocks, config.max_num_seqs, self.blocks.blocks_for))
        return Speculation(make_proposer(spec, runtime, draft_factory), spec.make_policy(), spec.k_max)

    def _num_kv_blocks(self, loaded) -> int:
        """The KV cache's blocks: as configured, or what kv_cache_gib holds; at least one request's worth."""
        config = self.config
        per_block = ModelRunner.bytes_per_block(loaded.config, getattr(torch, config.dtype), config.block_size)
        num_blocks = config.num_kv_blocks or int(config.kv_cache_gib * 2**30 // per_block)
        if num_blocks * config.block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache ({num_blocks} blocks x {config.block_size} tokens = "
                f"{num_blocks * config.block_size} tokens) cannot hold one request of max_model_len="
                f"{self.max_model_len} tokens; raise kv_cache_gib / num_kv_blocks or lower max_model_len")
        return num_blocks

    def draft_runtime(self, num_blocks: int, spec: SpeculativeConfig | None = None) -> DraftRuntime:
        """How a draft model for this target is built: its vocabulary and this engine's runtime options. spec: the
        speculation it drafts for (default: the configured one), which sets the steps its runner's graphs cover."""
        c = self.config
        return DraftRuntime(self.tokenizer, self.vocab_size, num_blocks, c.block_size, c.use_kernels, c.dtype,
                            c.device, c.quantization, c.enable_prefix_caching,
                            self.bucket_limits(spec, draft=True) if c.cuda_graphs else None)

    def bucket_limits(self, spec: SpeculativeConfig | None = None, draft: bool = False) -> BucketLimits:
        """The decode and verify steps this engine can form, which a runner's padded buckets cover: up to
        max_num_seqs rows of 1 + k_max tokens within max_model_len, token-tree masks where trees or request hints
        (verified as trees) can come. The draft model's: its own trees only, and a tree's fed levels past the
        target's context end (spec_decode/draft_tree.py holds room for them). spec: default, the configured one."""
        c = self.config
        spec = spec or c.speculative_config
        k_max = spec.k_max if spec else 0
        trees = spec is not None and (spec.tree is not None or (spec.request_hints and not draft))
        fed = spec.tree.branching * (spec.tree.max_depth - 1) if draft and spec and spec.tree else 0
        return BucketLimits(c.max_num_seqs, 1 + k_max, self.max_model_len + fed, c.block_size, trees,
                            c.max_cuda_graphs)

    def set_speculation(self, proposer: Proposer | None = None, policy: Policy | None = None,
                        k_max: int | None = None) -> None:
        """Swap the proposer, the policy or k_max between runs (benchmarks compare configurations on one loaded
        target); what is not given stays. Only while no request is in flight: a proposer holds per-request state.
        The policy is an instance (`make_policy` or `SpeculativeConfig.make_policy` builds one from a name)."""
        if self.has_unfinished():
            raise RuntimeError("set_speculation needs an idle engine")
        if policy is not None and not isinstance(policy, Policy):
            raise TypeError(f"policy must be a Policy instance, got {type(policy).__name__}")
        self.observer.observe_waiting()  # a step the old policy planned (one whose requests were aborted)
        sp = self.speculation
        self.speculation = Speculation(proposer or sp.proposer, policy or sp.policy,
                                       sp.k_max if k_max is None else k_max)
        # wider steps than the target's buckets were planned for (a larger k_max, trees): planned again now, idle,
        # so that no step runs eagerly for want of a bucket
        limits = getattr(self.runner, "bucket_limits", None)
        if limits is not None and (self.speculation.k_max + 1 > limits.max_width or not limits.trees):
            self.runner.replan_buckets(replace(limits, max_width=max(limits.max_width, self.speculation.k_max + 1),
                                               trees=True))

    def warm_up_profile(self, batches: tuple[int, ...] | None = None, context: int = 64,
                        kept_ok: bool = True) -> KeptProfile:
        """The start's profile and acceptance calibration: those kept on disk for this configuration and machine,
        where config.profile_cache asks, kept_ok allows and there are (the policy observes them; one short request
        then warms the models up, and the first steps check them: `kept_check`); else measured (and kept, where
        asked). batches None: the runner's (profile.profile_batches)."""
        from smartspec.engine.profile import CALIBRATION_KEY, calibrate_acceptance, take_calibration, warm_up_forwards
        batches = batches or self.profile_batches()
        path = profile_path(self.config, batches, context, CALIBRATION_KEY) \
            if self.config.profile_cache else None
        if path is not None and kept_ok and (kept := load_profile(path)) is not None:
            self.speculation.policy.observe_profile(kept.records)
            take_calibration(self.speculation, kept.calibration)
            warm_up_forwards(self, context)
            self.kept_check = KeptProfileCheck(path)
            return kept
        measured = KeptProfile(self.profile_steps(batches, context), calibrate_acceptance(self))
        if path is not None:
            save_profile(path, measured)
        return measured

    def measure_profile_if_due(self) -> bool:
        """Measure the warm-up profile again where the first steps found the kept one stale (KeptProfileCheck),
        once the engine is idle (its requests would share the profile's steps otherwise). Whether it ran."""
        if not self.profile_due or self.has_unfinished():
            return False
        self.profile_due = False
        self.warm_up_profile(kept_ok=False)
        return True

    def profile_steps(self, batches: tuple[int, ...] | None = None, context: int = 64) -> list[StepRecord]:
        """Measure a few step shapes and hand them to the policy's cost model (see engine/profile.py); batches None:
        the runner's (profile_batches)."""
        from smartspec.engine.profile import profile_steps
        return profile_steps(self, batches or self.profile_batches(), context)

    def profile_batches(self) -> tuple[int, ...]:
        """The batch sizes the warm-up profile runs on this engine's runner (engine/profile.py)."""
        from smartspec.engine.profile import profile_batches
        return profile_batches(self.runner.padded_shapes is not None, self.config.max_num_seqs)

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()
        self.runner.close()
        if self.speculation.proposer is not None:
            self.speculation.proposer.close()

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

    def check_request(self, prompt: str | list[int], params: SamplingParams) -> tuple[list[int], SamplingParams]:
        """The prompt's token ids, once the request is known to fit this model (its context and vocabulary) and its
        controls to admit an output (structured/feasible.py), and its params with a structured output's grammar
        compiled for this tokenizer (so no later stage compiles it)."""
        ids = self.tokenize(prompt)
        if (bad := [t for t in params.logit_bias if t >= self.vocab_size]):
            raise ParamError("logit_bias", f"logit_bias names token id {bad[0]}, outside the vocabulary "
                                           f"[0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; the context holds {self.max_model_len} "
                             f"(max_model_len), leaving no room to generate")
        grammar = None
        if params.structured is not None:
            params = replace(params, structured=compiled(params.structured,
                                                         self.grammar_compiler.tool_tags_are_tokens))
            self.grammar_compiler.check(params.structured)
            grammar = self.grammar_compiler.matcher(params.structured)
        refuse_impossible(params, grammar, params.structured.compiled[1] if grammar is not None else None,
                          self.vocab_size, self.stop_token_ids)
        return ids, params

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        ids, params = self.check_request(prompt, params)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        gen = None
        if not params.greedy:
            gen = (torch.Generator(device=self.config.device).manual_seed(params.seed)
                   if params.seed is not None else self._generator)
        req = Request(request_id, ids, params, gen)
        if params.structured is not None:
            self.grammars[request_id] = self.grammar_compiler.matcher(params.structured)
        if params.prediction:
            self.hints.add_prediction(request_id, self.tokenizer(params.prediction, add_special_tokens=False).input_ids
                                      if isinstance(params.prediction, str) else list(params.prediction))
        self.requests[request_id] = req
        self.scheduler.add(req)
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        self._forget(request_id)
        finish_request(req, "abort", self.scheduler, self.speculation, time.monotonic())
        return output_of(req, [], take_text(req))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def snapshot(self) -> EngineSnapshot:
        """What a serving replica reports: load, KV blocks, prefix cache hits, speculation counters, step totals,
        the draft's health, the policy's shareable state and what more load costs."""
        sp, proposer = self.speculation, self.speculation.proposer
        draft = None if proposer is None else DraftHealth(proposer.draft_available, proposer.failures,
                                                          proposer.incarnation)
        return EngineSnapshot(len(self.scheduler.running), len(self.scheduler.waiting), self.blocks.num_free,
                              self.blocks.num_blocks, self.scheduler.max_num_seqs, sp.policy.name,
                              self.blocks.num_prefix_queries, self.blocks.num_prefix_hits, sp.metrics.copy(),
                              self.stats.snapshot(), draft, sp.policy.shared.export_state(), self.load_costs())

    def load_costs(self, context: int = 512, chunk: int = 256) -> LoadCosts:
        """What more load costs here, from the policy's fits (None where it has none), for routing and autoscaling:
        `request_speed`, the tokens per second of one request at batch sizes 1, 2, 4, ... up to max_num_seqs (for
        the running requests' mean context, else `context`), and `prefill_s_per_token`, a prompt token's share of
        a `chunk`-token prefill."""
        policy, cap, running = self.speculation.policy, self.scheduler.max_num_seqs, self.scheduler.running
        sizes = sorted({min(2 ** i, cap) for i in range(cap.bit_length() + 1)})
        if running:
            context = sum(r.num_tokens for r in running) // len(running)
        full, one = policy.load.step_seconds(chunk + 1, context + chunk), policy.load.step_seconds(1, context)
        return LoadCosts(policy.load.request_speed(sizes, context, self.speculation.k_max),
                         max(0.0, full - one) / chunk if full is not None else None)

    # ---- the step -------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step with this engine's speculation; the totals and the trace record it, and the policy observes it
        beside the next step's forward (engine/step_observer.py), or at once where no step follows."""
        observer = self.observer
        result = self.run_step(self.speculation, self.num_steps + 1,
                               lambda view: observer.beside_forward(self.speculation.policy, view))
        record, observe_s = result.record, result.beside_s
        if record is not None:
            self.num_steps += 1
            self.last_step = record
            try:
                if self.trace is not None:
                    self.trace.add(record)
            except Exception:
                logger.exception("the trace failed to record step %d", self.num_steps)
            observe_s += observer.hold(self.speculation.policy, record)
            if not self.scheduler.has_unfinished():  # no forward follows to observe it beside
                observe_s += observer.observe_waiting()
            self.stats.add(record, result.generated, result.plan_s + observe_s)
            if self.kept_check is not None and (stale := self.kept_check.observe(record)) is not None:
                self.kept_check, self.profile_due = None, stale
        return result.outputs

    def run_step(self, spec: Speculation, step_number: int = 0,
                 beside_forward: Callable[[StepView | None], float] = lambda view: 0.0) -> StepResult:
        """schedule -> plan -> propose -> verify -> accept -> commit, with the speculation given (the warm-up
        profile runs fixed plans through here); the record is returned, not observed. beside_forward: host work
        run once with the step's view, after the forward is issued and before its result is read (a device runs the
        forward meanwhile), or with None before returning where nothing was scheduled; it returns its seconds. A
        fault in one request's part ends that request alone (types/faults.py); a forward that fails is tried once
        more without drafts, and a second failure ends this step's requests, not the engine."""
        t_start = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch:
            return StepResult([], None, 0, beside_s=beside_forward(None))
        decoding, prefill = split_batch(batch)
        lengths = [r.num_tokens for r in decoding]  # as planned, before the step commits tokens
        budget = self.config.max_num_batched_tokens - sum(s.num_tokens for s in batch)
        hints = (self.hints.step_hints(decoding, self.grammars, spec.k_max)
                 if spec.proposer is not None and self.request_hints else None)
        t_plan = time.perf_counter()
        view, plan = plan_step(spec, decoding, prefill, DraftRoom(budget, self.blocks, self.max_model_len),
                               hints=hints, shapes=self.runner.padded_shapes)
        t_draft = time.perf_counter()
        drafted = cut_to_grammars(propose(spec, view, decoding, plan, hints), self.grammars)
        t_verify = time.perf_counter()
        verified = self._verify(batch, drafted)
        t_accept = time.perf_counter()
        beside_s = beside_forward(view)
        if verified is None:
            return StepResult(self._end_all(batch, spec), None, 0, beside_s=beside_s)
        items, drafted, logits = verified
        prompt_faults: dict[str, RequestFault] = {}
        logits, sampled = take_prompt_logprobs(items, logits, prompt_faults)
        verdicts = accept_drafts(sampled, logits, drafted.drafts, self.stop_token_ids, self.grammars,
                                 self.token_counts)
        verdicts.faults.update(prompt_faults)
        outputs, trees = self._commit(spec, items, sampled, logits, drafted, verdicts)
        t_end = time.perf_counter()
        new_tokens = verdicts.tokens
        record = self._record(step_number, items, PlannedStep(decoding, lengths, plan, drafted), new_tokens, trees,
                              StepTimes(t_verify - t_draft, t_accept - t_verify, t_end - t_start))
        return StepResult(outputs, record, sum(len(t) for t in new_tokens.values()), t_draft - t_plan, beside_s)

    def _verify(self, batch: list[ScheduledRequest], drafted: Drafted) \
            -> tuple[list[ForwardItem], Drafted, torch.Tensor] | None:
        """The target's forward over the batch with its drafts: (items, drafts, logits). A forward that raises is
        run once more without drafts (speculation's extra rows are the likeliest cause: a shape no bucket holds);
        None when that fails too."""
        for attempt in (drafted, Drafted(predicted_s=drafted.predicted_s)):
            items = [self._forward_item(s, attempt) for s in batch]
            try:
                return items, attempt, self.runner.forward(items)
            except Exception:
                logger.exception("the forward of a %d-request step failed %s", len(batch),
                                 "again without speculation: its requests end" if attempt is not drafted
                                 else "; trying it once without speculation")
        return None

    def _end_all(self, batch: list[ScheduledRequest], spec: Speculation) -> list[RequestOutput]:
        """End every request of a step whose forward failed twice (the next step's requests are not touched)."""
        fault = RequestFault("forward", "the model's forward failed twice for the step this request was in")
        return [self._end_with_fault(s.request, fault, spec) for s in batch]

    def _forget(self, request_id: str) -> None:
        """A request that ends: what the engine keeps of it besides its blocks (its grammar, hints, counts) goes."""
        self.requests.pop(request_id, None)
        self.grammars.pop(request_id, None)
        self.hints.release(request_id)
        self.token_counts.release(request_id)

    def _end_with_fault(self, req: Request, fault: RequestFault, spec: Speculation) -> RequestOutput:
        """End one request whose part of a step failed: finish reason "error", the fault as its error, its KV back."""
        rid = req.request_id
        self._forget(rid)
        req.error = str(fault)
        try:
            finish_request(req, "error", self.scheduler, spec, time.monotonic())
        except Exception:  # its blocks went back first; what failed is the proposer or the policy forgetting it
            logger.exception("request %s: releasing it after its fault failed", rid)
        return output_of(req, [], "")

    @staticmethod
    def _forward_item(s: ScheduledRequest, drafted: Drafted) -> ForwardItem:
        """A scheduled chunk as the runner feeds it: with its drafts (a chain after the last token, or a tree)."""
        req, c = s.request, s.request.num_computed_tokens
        draft = drafted.drafts.get(req.request_id)
        if draft is not None and draft.tree is not None:
            return tree_item(req, draft.tree)
        tokens = draft.tokens if draft is not None else []
        num_logits = 1 + len(tokens) if s.completes else 0
        if req.prompt_logprobs is not None and c < req.num_prompt_tokens:
            num_logits = s.num_tokens  # every position's row, for the prompt's logprobs
        return ForwardItem(req, req.token_ids[c:c + s.num_tokens] + list(tokens), c, num_logits)

    def _commit(self, spec: Speculation, items: list[ForwardItem], sampled: list[ForwardItem], logits: torch.Tensor,
                drafted: Drafted, verdicts: Verdicts) -> tuple[list[RequestOutput], dict[str, VerifiedTree]]:
        """Every fed token is computed; each request due a token takes its new tokens, and each request with a
        fault ends. Returns the outputs and the verified trees with their accepted paths (for the policy)."""
        for it in items:
            it.request.num_computed_tokens += len(it.tokens)
        logprobs = step_logprobs(sampled, logits, drafted.drafts, verdicts)
        outputs, trees = [], {}
        now = time.monotonic()
        for it in items:
            req = it.request
            rid = req.request_id
            fault = verdicts.faults.get(rid)
            if fault is None and rid in verdicts.tokens:
                try:
                    outputs.append(self._commit_one(spec, it, drafted.drafts.get(rid), verdicts.tokens[rid], logprobs,
                                                    trees, now))
                    continue
                except Exception as exc:
                    fault = fault_of(exc, rid, "commit")
            if fault is not None:
                outputs.append(self._end_with_fault(req, fault, spec))
        return outputs, trees

    def _commit_one(self, spec: Speculation, it: ForwardItem, draft: Draft | None, new: list[int],
                    logprobs: dict[str, list[TokenLogprob] | Exception], trees: dict[str, VerifiedTree],
                    now: float) -> RequestOutput:
        """One request takes its new tokens (up to a stop); its output. Raises what fails, labelled by stage."""
        req = it.request
        if draft is not None and draft.tree is not None:
            path = draft.tree.follow(new[:-1])
            trees[req.request_id] = VerifiedTree(draft.tree, path)
            with stage("commit"):
                self._keep_path(it, path)
        mine = None
        if req.params.logprobs is not None:
            with stage("logprobs"):
                mine = logprobs_of(logprobs, req.request_id)
        done = self.committer.commit(req, new, len(draft.tokens) if draft is not None else 0, spec, now,
                                     self.grammars.get(req.request_id), draft.source if draft is not None else None)
        if done.finish_reason is not None:
            self._forget(req.request_id)
            finish_request(req, done.finish_reason, self.scheduler, spec, time.monotonic())
        elif spec.proposer is not None:
            with stage("commit"):
                spec.proposer.sync(req)
        if mine is not None:
            req.logprobs.extend(mine[:len(done.added)])
        with stage("output"):
            return output_of(req, done.added, take_text(req))

    def _keep_path(self, item: ForwardItem, path: list[int]) -> None:
        """A token tree's accepted nodes move next to the context, so the cache is the committed sequence."""
        src = [item.start + 1 + node for node in path]
        dst = [item.start + 1 + depth for depth in range(len(path))]
        if src != dst:
            self.runner.copy_kv([self.blocks.slot(item.request, p) for p in src],
                                [self.blocks.slot(item.request, p) for p in dst])

    def _record(self, step_number: int, items: list[ForwardItem], planned: PlannedStep,
                new_tokens: dict[str, list[int]], trees: dict[str, VerifiedTree], times: StepTimes) -> StepRecord:
        decoding, plan, drafted, shapes = planned.decoding, planned.plan, planned.drafted, self.runner.padded_shapes
        drafts = drafted.drafts
        tokens = sum(len(it.tokens) for it in items)
        decoding_ids = {r.request_id for r in decoding}
        num_prefill = sum(len(it.tokens) for it in items if it.request.request_id not in decoding_ids)
        proposed = [len(drafts[r.request_id].tokens) if r.request_id in drafts else 0 for r in decoding]
        return StepRecord(
            step=step_number, batch_size=len(items), ks=list(plan.ks), proposed=proposed,
            accepted=[len(new_tokens.get(r.request_id, [None])) - 1 if p else 0 for r, p in zip(decoding, proposed)],
            request_ids=[r.request_id for r in decoding],
            num_batched_tokens=tokens,
            forward_tokens=tokens if shapes is None else shapes.forward_tokens(
                len(items), max(len(it.tokens) for it in items), tokens),
            num_prefill_tokens=num_prefill,
            num_context_tokens=sum(fed_context(it.start, len(it.tokens), it.request.request_id not in decoding_ids)
                                   for it in items),
            draft_s=times.draft_s, verify_s=times.verify_s, total_s=times.total_s,
            predicted_s=drafted.predicted_s if decoding else None,
            draft_catchup_tokens=drafted.catchup_tokens if drafts else 0,
            methods=plan.methods, trees=trees, num_tokens=planned.lengths, probes=list(plan.probes))


def tree_item(req: Request, tree: TokenTree) -> ForwardItem:
    """A decoding request's root (its last token) and tree nodes: stored side by side, each node at its depth."""
    c = req.num_computed_tokens
    return ForwardItem(req, [req.token_ids[c]] + tree.tokens, c, 1 + len(tree),
                       positions=[c] + [c + d for d in tree.depths()], tree_base=c, tree_masks=tree.ancestor_masks())
