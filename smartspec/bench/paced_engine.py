"""An engine without a model that emits one token for every running request each `step_s` seconds: what
scripts/bench_serving_path.py serves to measure the serving path alone (Serve's proxy, the ingress, the replica,
the wire) at a token rate a GPU would produce. It stands where LLMEngine stands under AsyncEngine, so the replica
runs as it does over a model; its steps' own CPU time is counted in `steps.busy_s`, which the benchmark takes out.

Outputs are the text of a fixed cycle of byte tokens (the tests' byte-level tokenizer), `max_tokens` of them."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from smartspec.bench.tiny_models import byte_tokenizer
from smartspec.engine.outputs import RequestOutput
from smartspec.types.metrics import RequestMetrics, SpecDecodeMetrics
from smartspec.types.sampling_params import SamplingParams
from smartspec.types.snapshot import EngineSnapshot, LoadCosts, StepTotals

CYCLE_TEXT = "the quick brown fox jumps over the lazy dog "  # what every answer repeats


@dataclass
class _Running:
    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    arrival: float
    token_ids: list[int]
    first_token_time: float | None = None


class _NoGrammars:
    """The replica warms the grammar compiler at start; a paced engine takes no structured requests."""

    def warm(self) -> None:
        return None


class _NoSharedState:
    def import_state(self, state: dict) -> None:
        return None


class _NoPolicy:
    shared = _NoSharedState()


class _NoSpeculation:
    policy = _NoPolicy()


class PacedEngine:
    """What AsyncEngine drives of an LLMEngine, with a clock for its model: each step emits a token to every
    running request (up to max_num_seqs of them, the rest wait), then waits out the rest of its `step_s`."""

    speculation = _NoSpeculation()
    grammar_compiler = _NoGrammars()

    def __init__(self, step_s: float, max_num_seqs: int = 256, max_model_len: int = 4096) -> None:
        if not (step_s > 0 and max_num_seqs >= 1 and max_model_len >= 2):
            raise ValueError(f"step_s must be > 0, max_num_seqs >= 1, max_model_len >= 2: got {step_s!r}, "
                             f"{max_num_seqs!r}, {max_model_len!r}")
        self.step_s, self.max_num_seqs, self.max_model_len = step_s, max_num_seqs, max_model_len
        self.tokenizer = byte_tokenizer()
        self.cycle = self.tokenizer.encode(CYCLE_TEXT)
        self.texts = {t: self.tokenizer.decode([t]) for t in self.cycle}
        self.blocks = _Blocks(max_model_len * max_num_seqs)
        self.running: dict[str, _Running] = {}
        self.waiting: deque[_Running] = deque()
        self.totals = StepTotals()
        self.next_step = time.monotonic()

    # ---- requests ----------------------------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return list(prompt) if isinstance(prompt, list) else self.tokenizer.encode(prompt)

    def check_request(self, prompt: str | list[int], params: SamplingParams) -> tuple[list[int], SamplingParams]:
        ids = self.tokenize(prompt)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; the context holds {self.max_model_len} (max_model_len)")
        if params.structured is not None:
            raise ValueError("the paced engine takes no structured outputs")
        return ids, params

    def add_request(self, ids: list[int], params: SamplingParams, request_id: str) -> None:
        max_tokens = min(params.max_tokens, self.max_model_len - len(ids))
        self.waiting.append(_Running(request_id, len(ids), max_tokens, time.monotonic(), []))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.running.pop(request_id, None)
        if req is None:
            found = [r for r in self.waiting if r.request_id == request_id]
            if not found:
                return None
            req = found[0]
            self.waiting.remove(req)
        return self._output(req, [], "abort")

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    # ---- the step ------------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One token to each running request, at this step's time on the clock."""
        self._wait_for_the_clock()
        began = time.thread_time()
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting.popleft()
            self.running[req.request_id] = req
        now, outputs = time.monotonic(), []
        for req in list(self.running.values()):
            token = self.cycle[len(req.token_ids) % len(self.cycle)]
            req.token_ids.append(token)
            if req.first_token_time is None:
                req.first_token_time = now
            done = len(req.token_ids) >= req.max_tokens
            if done:
                del self.running[req.request_id]
            outputs.append(self._output(req, [token], "length" if done else None))
        self.totals.steps += 1
        self.totals.generated_tokens += len(outputs)
        self.totals.busy_s += time.thread_time() - began
        return outputs

    def _wait_for_the_clock(self) -> None:
        """Steps every step_s; a step that runs late starts the clock again from now (no burst of catch-up)."""
        now = time.monotonic()
        if self.next_step > now:
            time.sleep(self.next_step - now)
        self.next_step = max(self.next_step, now) + self.step_s

    def _output(self, req: _Running, new: list[int], finish_reason: str | None) -> RequestOutput:
        finished = finish_reason is not None
        text = "".join(self.texts[t] for t in new)
        metrics = RequestMetrics(req.arrival, req.first_token_time, time.monotonic() if finished else None, 0,
                                 SpecDecodeMetrics())
        # the output so far as of this step, a copy as LLMEngine's is (an output read after later steps must not
        # see their tokens); its text is not read by the replica on the way
        return RequestOutput(req.request_id, new, text, list(req.token_ids), "", finished, finish_reason,
                             req.num_prompt_tokens, metrics)

    # ---- what the replica reads ----------------------------------------------------------------------------------
    def snapshot(self) -> EngineSnapshot:
        return EngineSnapshot(len(self.running), len(self.waiting), self.blocks.num_free, self.blocks.num_blocks,
                              self.max_num_seqs, "off", 0, 0, SpecDecodeMetrics(), self.totals.snapshot(), None,
                              None, LoadCosts())

    def load_costs(self) -> LoadCosts:
        return LoadCosts()

    def measure_profile_if_due(self) -> None:
        return None

    def close(self) -> None:
        return None


@dataclass
class _Blocks:
    """The KV capacity the replica reports (one block per token: the paced engine keeps none)."""
    num_blocks: int
    block_size: int = 1

    @property
    def num_free(self) -> int:
        return self.num_blocks


