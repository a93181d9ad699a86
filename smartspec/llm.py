"""The offline API: LLM(model=...).generate(prompts, params)."""
from __future__ import annotations

import sys
from dataclasses import dataclass

from smartspec.config import EngineConfig
from smartspec.engine.llm_engine import LLMEngine
from smartspec.types.logprobs import TokenLogprob
from smartspec.types.metrics import SpecDecodeMetrics
from smartspec.types.sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    prompt: str | list[int]
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    ttft_s: float | None  # arrival to first token (None: it ended with an error before one)
    latency_s: float  # arrival to finish
    logprobs: list[TokenLogprob] | None = None  # per output token, when SamplingParams.logprobs asked
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token (the first None), when asked
    speculation: SpecDecodeMetrics | None = None  # this request's draft counters
    error: str | None = None  # finish_reason "error": what failed in the server, naming the stage and feature


class LLM:
    def __init__(self, model: str = "qwen2.5-coder-1.5b", **engine_options) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: str | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 progress: bool = False) -> list[CompletionOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} SamplingParams for {len(prompts)} prompts")
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, plist)]
        done: dict[str, object] = {}
        logprobs: dict[str, list] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.new_logprobs is not None:
                    logprobs.setdefault(out.request_id, []).extend(out.new_logprobs)
                if out.finished:
                    done[out.request_id] = out
                    if progress:
                        print(f"\rsmartspec: {len(done)}/{len(ids)} requests done", end="", file=sys.stderr)
        if progress:
            print(file=sys.stderr)
        results = []
        for rid, prompt in zip(ids, prompts):
            out = done[rid]
            m = out.metrics
            first = m.first_token_time
            results.append(CompletionOutput(
                prompt, self.engine.tokenize(prompt), list(out.token_ids), out.text, out.finish_reason,
                None if first is None else first - m.arrival_time, m.finish_time - m.arrival_time,
                logprobs.get(rid, []) if out.new_logprobs is not None else None, out.prompt_logprobs,
                m.spec_decode, out.error))
        return results
