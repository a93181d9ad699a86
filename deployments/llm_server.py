"""LLMServer: one engine per replica, stepping on its own thread; requests stream back through the handle.

Every request's stream starts with {"type": "accepted"} or {"type": "error", "status", "message"}, so the
ingress knows the status code before it sends headers; then {"type": "delta"} items, the last with finished.
A caller that goes away (a client disconnect cancels the handle call) aborts its request and frees its blocks."""
from __future__ import annotations

import asyncio
import os
import logging
import uuid
from collections.abc import AsyncIterator

import ray
from ray import serve

from deployments.config import AppConfig
from deployments.openai_protocol import token_entries
from smartspec.engine.async_engine import AsyncEngine
from smartspec.engine.llm_engine import LLMEngine
from smartspec.sampling_params import SamplingParams

logger = logging.getLogger("ray.serve")


def _error(status: int, message: str) -> dict:
    return {"type": "error", "status": status, "message": message}


@serve.deployment(name="LLMServer")
class LLMServer:
    def __init__(self, config: dict, controller=None) -> None:
        self.cfg = AppConfig.model_validate(config)
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id if context else uuid.uuid4().hex[:8]
        self.draft_actor_name = None
        self.engine = AsyncEngine(build=lambda: LLMEngine(self.cfg.engine_config(self.replica_id),
                                                          runner_factory=self._runner_factory(),
                                                          proposer_factory=self._proposer_factory()))
        self.controller = controller
        self.controller_errors = 0
        self._report_task = asyncio.get_event_loop().create_task(self._report_loop()) if controller else None
        logger.info("LLMServer %s ready: %s, speculation %s", self.replica_id, self.cfg.model,
                    self.cfg.speculation.as_dict() if self.cfg.speculation else None)

    # ---- where the parts run ------------------------------------------------------------------------------
    def _runner_factory(self):
        cfg = self.cfg
        if cfg.tensor_parallel_size == 1:
            return None
        from deployments.tp_workers import TPModelRunner

        gpus = 1 if cfg.device == "cuda" else 0
        quantization = cfg.engine_config().quantization  # as the engine reads it ("auto" without kernels: None)
        return lambda loaded, blocks: TPModelRunner(loaded, blocks, cfg.tensor_parallel_size, "float32", cfg.device,
                                                    cfg.tp_num_cpus, cfg.threads, num_gpus=gpus,
                                                    quantization=quantization)

    def _proposer_factory(self):
        if not self.cfg.draft_actor:
            return None
        from deployments.draft_worker import DraftWorker, RemoteDraftProposer

        def make(spec_config, engine, num_blocks):
            if spec_config.methods:  # the draft model in its actor, beside the in-process lookups
                from smartspec.engine.llm_engine import make_proposer
                from smartspec.spec_decode.mixed import MixedProposer
                return MixedProposer(make(spec_config.single("draft_model"), engine, num_blocks),
                                     make_proposer(spec_config.single("suffix"), engine, num_blocks))
            from smartspec.models import load_model

            # a mismatched pair is a configuration error: say so now, not in an actor restarting forever
            if load_model(spec_config.model, weights=False).tokenizer.get_vocab() != engine.tokenizer.get_vocab():
                raise ValueError(f"draft model {spec_config.model!r} does not share the tokenizer of "
                                 f"{self.cfg.model!r}; draft and target must use the same vocabulary")
            self.draft_actor_name = f"smartspec-draft-{self.replica_id}"
            actor = ray.remote(DraftWorker).options(
                name=self.draft_actor_name, num_cpus=spec_config.draft_num_cpus, max_restarts=-1, max_task_retries=0,
            ).remote(spec_config.model, self.cfg.model, engine.vocab_size, num_blocks, engine.config.block_size,
                     engine.config.use_kernels, engine.config.dtype, engine.config.device,
                     spec_config.draft_num_threads or self.cfg.threads,
                     {"max_depth": spec_config.tree.max_depth, "branching": spec_config.tree.branching}
                     if spec_config.tree else None, quantization=engine.config.quantization,
                     enable_prefix_caching=engine.config.enable_prefix_caching)
            return RemoteDraftProposer(actor)

        return make

    # ---- requests -----------------------------------------------------------------------------------------
    def _prompt(self, body: dict) -> str | list[int]:
        if "messages" not in body:
            return body["prompt"]
        tokenizer = self.engine.engine.tokenizer
        if not tokenizer.chat_template:
            raise ValueError(f"model {self.cfg.name!r} has no chat template; use /v1/completions")
        return tokenizer.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)

    async def generate(self, body: dict) -> AsyncIterator[dict]:
        """body: {"prompt": str | [ids]} or {"messages": [...]}, "params": SamplingParams fields, "request_id"."""
        limit = self.cfg.max_num_seqs + self.cfg.max_waiting
        if self.engine.num_in_flight >= limit:
            yield _error(429, f"replica overloaded: {self.engine.num_in_flight} requests in flight (limit {limit}); "
                              "retry later")
            return
        try:
            prompt = self._prompt(body)
            fields = dict(body.get("params", {}))
            if fields.get("max_tokens") is None:
                fields["max_tokens"] = self.engine.engine.max_model_len  # the request ends at the context's end
            params = SamplingParams(**fields)
            rid = body.get("request_id") or uuid.uuid4().hex
            num_prompt_tokens, stream = self.engine.submit(prompt, params, rid)
            accepted = {"type": "accepted", "prompt_tokens": num_prompt_tokens}
            if body.get("echo"):
                accepted.update(self._echo(prompt))
        except (ValueError, TypeError, KeyError) as exc:  # bad prompt, sampling fields or values; over the context
            yield _error(400, f"invalid request: {exc}" if not isinstance(exc, ValueError) else str(exc))
            return
        except RuntimeError as exc:  # the engine stopped after an error: this replica is unhealthy
            yield _error(503, str(exc))
            return
        tokenizer = self.engine.engine.tokenizer
        try:
            yield accepted
            first = True
            async for out in stream:
                yield {"type": "delta", "first": first, "text": out.new_text, "token_ids": out.new_token_ids,
                       "finished": out.finished, "finish_reason": out.finish_reason,
                       "completion_tokens": len(out.token_ids),
                       "spec": out.metrics["spec_decode"] if out.finished else None,
                       "logprobs": None if out.new_logprobs is None else token_entries(tokenizer, out.new_logprobs),
                       "prompt_logprobs": token_entries(tokenizer, out.prompt_logprobs)
                       if first and out.prompt_logprobs is not None else None}
                first = False
        finally:
            await stream.aclose()  # a caller gone before the end: abort the request, free its blocks
            self.engine.discard(rid)  # (aclose of a stream never started runs none of its cleanup)

    def _echo(self, prompt: str | list[int]) -> dict:
        """What a completion with echo needs of its prompt: the text, and its first token's (which has no logprob)."""
        tokenizer = self.engine.engine.tokenizer
        ids = self.engine.engine.tokenize(prompt)
        return {"prompt_text": prompt if isinstance(prompt, str) else tokenizer.decode(ids),
                "prompt_first_token": tokenizer.decode(ids[:1])}

    # ---- state, health, controller -------------------------------------------------------------------------
    async def stats(self) -> dict:
        def read(engine: LLMEngine) -> dict:
            policy = engine.speculator.policy
            return {"replica": self.replica_id, "running": len(engine.scheduler.running),
                    "waiting": len(engine.scheduler.waiting), "free_blocks": engine.blocks.num_free,
                    "total_blocks": engine.blocks.num_blocks, "policy_name": policy.name,
                    "prefix_cache": {"queries": engine.blocks.num_prefix_queries,
                                     "hits": engine.blocks.num_prefix_hits},
                    "spec_decode": engine.speculator.metrics.as_dict(), "steps": engine.stats.snapshot(),
                    "draft_available": (getattr(engine.speculator.proposer, "draft_available",
                                                engine.speculator.proposer.available)
                                        if engine.speculator.proposer is not None else None),
                    "draft_actor": self.draft_actor_name, "namespace": ray.get_runtime_context().namespace,
                    "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                    "draft_failures": getattr(engine.speculator.proposer, "failures", None),
                    "draft_incarnation": getattr(engine.speculator.proposer, "incarnation", None),
                    "policy_state": policy.export_state() if hasattr(policy, "export_state") else None}

        out = await self.engine.call(read)
        out["in_flight"] = self.engine.num_in_flight
        out["controller_errors"] = self.controller_errors
        return out

    async def _report_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.controller_interval_s)
            try:
                stats = await self.stats()
                report = {k: v for k, v in stats.items() if k != "policy_state"}
                report["policy"] = stats["policy_state"]
                merged = await asyncio.wait_for(self.controller.report.remote(self.replica_id, report), 10)
                if merged:
                    await self.engine.call(lambda e: e.speculator.policy.import_state(merged))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the controller is gone or slow: keep the last parameters, keep serving
                self.controller_errors += 1
                if self.controller_errors in (1, 10) or self.controller_errors % 100 == 0:
                    logger.warning("goodput controller unreachable (%d times): %r", self.controller_errors, exc)

    def ping(self) -> bool:
        return self.engine.errored is None

    def check_health(self) -> None:
        if self.engine.errored is not None:
            raise RuntimeError(f"engine stopped after an error: {self.engine.errored!r}")

    def __del__(self) -> None:
        try:
            self.engine.engine.close()
        except Exception:
            pass
