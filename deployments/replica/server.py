"""LLMServer: one engine per replica, stepping on its own thread; requests stream back through the handle.

`generate` takes a `GenerateCall` and streams the wire's events (deployments/wire.py): `Accepted` or `Refused`
first, so the ingress knows the status code before it sends headers; then `Delta`s, the last with finished.
A caller that goes away (a client disconnect cancels the handle call) aborts its request and frees its blocks.
A streamed call with `channel` has its deltas carried by its caller's channel (`channel`, replica/channels.py)
while one is open: one message a step for all that caller's streams here."""
from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import replace

import ray
from ray import serve

from deployments.control.config import AppConfig
from deployments.placement.autoscaling import autoscaling_metrics
from deployments.placement.ledger import RoutingLedger
from deployments.replica.channels import ChannelHub, Member
from deployments.replica.orphans import OrphanWatch
from deployments.replica.deltas import HELD_DELTAS_S, delta_of, held
from deployments.replica.parts import EngineFactory, start_engine
from deployments.replica.prompts import ending_at_first_call, prompt_of
from deployments.wire import (Accepted, ChannelCall, ChannelOpen, Delta, DeltaBatch, Event, GenerateCall, Refused,
                             ReplicaGauges, ReplicaReport)
from smartspec.engine.client import EngineClient
from smartspec.engine.start_phases import StartPhases
from smartspec.runtime.heap import freeze_startup_heap
from smartspec.types.snapshot import EngineSnapshot, LoadCosts

logger = logging.getLogger("ray.serve")


def _process_age_s() -> float | None:
    """Seconds since this replica's process started (Ray's worker start, imports, the actor's creation); None
    where psutil (which Ray installs) is missing."""
    try:
        import psutil
    except ImportError:
        return None
    return time.time() - psutil.Process().create_time()


def _engine_logs_to_replica_log() -> None:
    """The engine's INFO lines (the phases of its start, which backends it runs) in this replica's log, through
    Serve's own handlers: the library logs under "smartspec" and leaves its level and handlers to its user."""
    engine_log = logging.getLogger("smartspec")
    engine_log.setLevel(logging.INFO)
    for handler in logger.handlers:
        if handler not in engine_log.handlers:
            engine_log.addHandler(handler)
    engine_log.propagate = False  # once, through Serve's handlers, not again through the root logger


@serve.deployment(name="LLMServer")
class LLMServer:
    def __init__(self, config: dict, controller=None, engine_factory: EngineFactory = start_engine) -> None:
        """engine_factory: what starts the engine (parts.start_engine; the serving path's benchmark starts one
        without a model, parts.start_paced_engine)."""
        phases = StartPhases(f"LLMServer {os.getpid()}", logger)
        _engine_logs_to_replica_log()
        if (age := _process_age_s()) is not None:
            phases.record("process start and imports", age)
        self.cfg = AppConfig.model_validate(config)
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # built outside Serve (the channel tests build it with an engine but no replica)
            self.replica_id = uuid.uuid4().hex[:8]
        self.draft_actor_name = None  # named once the draft actor is started

        def named(name: str) -> None:
            self.draft_actor_name = name

        with phases.phase("engine"):  # its own phases are logged as it builds (engine/start_phases.py)
            self.engine: EngineClient = engine_factory(self.cfg, self.replica_id, named)
        self.engine.warm_grammars()
        freeze_startup_heap()  # the engine lives as long as this process: its start is no collector's work
        self.controller = controller
        self.controller_errors = 0
        self.routing = RoutingLedger()  # what the router reads (record_routing_stats)
        self._report_task = asyncio.get_event_loop().create_task(self._report_loop()) if controller else None
        self.orphans = OrphanWatch(self.engine.abort, self.cfg.orphan_check_s)
        self.generations = {"submitted": 0, "completed": 0}  # taken, and answered to their end (not aborted)
        self.channels = ChannelHub(self.cfg.stream_interval_ms / 1e3)
        logger.info("LLMServer %s ready: %s, speculation %s", self.replica_id, self.cfg.model,
                    self.cfg.speculation.as_dict() if self.cfg.speculation else None)
        phases.done()

    # ---- requests -----------------------------------------------------------------------------------------
    async def generate(self, call: GenerateCall) -> AsyncIterator[Event]:
        limit = self.cfg.max_num_seqs + self.cfg.max_waiting
        if self.engine.num_in_flight >= limit:
            yield Refused(429, f"replica overloaded: {self.engine.num_in_flight} requests in flight (limit {limit}); "
                               "retry later")
            return
        try:
            accepted, stream = self._submit(call)
        except (ValueError, TypeError, KeyError) as exc:  # bad prompt, sampling fields or values; over the context
            self.engine.discard(call.request_id)  # (where it was queued before the error)
            yield Refused(400, f"invalid request: {exc}" if not isinstance(exc, ValueError) else str(exc),
                          getattr(exc, "field", None))
            return
        except RuntimeError as exc:  # the engine stopped after an error: this replica is unhealthy
            yield Refused(503, str(exc))
            return
        started = time.monotonic()
        self.generations["submitted"] += 1
        self.orphans.add(call.request_id, call.caller)
        member = self.channels.join(call.caller, call.request_id) if call.channel and call.caller else None
        try:
            if member is not None:
                yield replace(accepted, replica_id=self.replica_id, open_channel=not member.channel_open)
                async with aclosing(self._by_channel(member, self._deltas(stream, started))) as sent_here:
                    async for ready in sent_here:
                        yield ready
                return
            yield accepted
            hold_s = self.cfg.stream_interval_ms / 1e3 if call.streamed else HELD_DELTAS_S
            async for ready in held(self._deltas(stream, started), hold_s, timed=call.streamed):
                yield ready
        finally:
            if member is not None:
                member.leave()
            self.orphans.remove(call.request_id)
            await stream.aclose()  # a caller gone before the end: abort the request, free its blocks
            self.engine.discard(call.request_id)  # (aclose of a stream never started runs none of its cleanup)

    @staticmethod
    async def _by_channel(member: Member, deltas: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
        """What a channel's member sends on its own stream: deltas while its caller has no channel open here, and
        those a channel gave back; after its last delta, it waits for that to go."""
        async for delta in deltas:
            for ready in member.route(delta):
                yield ready
        for ready in await member.rest():
            yield ready

    async def channel(self, call: ChannelCall) -> AsyncIterator[ChannelOpen | DeltaBatch]:
        """The caller's channel to this replica (the router sends a ChannelCall to the replica it names): the
        deltas of all the caller's channel streams here, a batch a step (replica/channels.py)."""
        if call.replica_id != self.replica_id:  # routed elsewhere (a router that does not pin): no channel
            return
        async for item in self.channels.attach(call.caller):
            yield item

    async def _deltas(self, stream: AsyncIterator, started: float) -> AsyncIterator[Delta]:
        """The engine's outputs as the wire's deltas, a finished generation counted."""
        first = True
        async for out in stream:
            if out.finished:
                self.generations["completed"] += out.finish_reason in ("stop", "length")
                self.routing.finished(time.monotonic() - started)
            yield delta_of(out, first, self.engine.tokenizer)
            first = False

    def _submit(self, call: GenerateCall) -> tuple[Accepted, AsyncIterator]:
        prompt = prompt_of(call, self.engine.tokenizer, self.cfg.name)
        params = call.params
        if call.until_context_end:
            params = replace(params, max_tokens=self.engine.max_model_len)
        if call.one_tool_call:
            params = ending_at_first_call(params, self.engine.tokenizer)
        num_prompt_tokens, stream = self.engine.submit(prompt, params, call.request_id)
        self.routing.accepted(call.prefix_text, num_prompt_tokens)
        if not call.echo:
            return Accepted(num_prompt_tokens), stream
        ids = self.engine.tokenize(prompt)  # the first token has no logprob: its text goes with the acceptance
        tokenizer = self.engine.tokenizer
        return Accepted(num_prompt_tokens, prompt if isinstance(prompt, str) else tokenizer.decode(ids),
                        tokenizer.decode(ids[:1])), stream

    # ---- state, health, controller -------------------------------------------------------------------------
    async def stats(self) -> dict:
        """The replica's /status view of itself (JSON): its engine's snapshot, where it runs, what it serves."""
        return self._status(await self.engine.snapshot())

    def _status(self, snapshot: EngineSnapshot, with_policy_state: bool = True) -> dict:
        out = {"replica": self.replica_id, **snapshot.as_dict(with_policy_state)}
        out.update({"draft_actor": self.draft_actor_name, "namespace": ray.get_runtime_context().namespace,
                    "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()})
        out["in_flight"] = self.engine.num_in_flight
        out["generations"] = {**self.generations, "orphans_aborted": self.orphans.aborted}
        out["channels"] = self.channels.stats()
        out["controller_errors"] = self.controller_errors
        return out

    async def record_routing_stats(self) -> dict:
        """What the goodput router weighs this replica by (Serve asks every router_stats_period_s)."""
        costs = await self._load_costs()
        return self.routing.stats(self.engine.num_in_flight, self.cfg.max_num_seqs, costs,
                                  self.engine.kv_capacity_tokens).as_dict()

    async def record_autoscaling_stats(self) -> dict:
        """What the goodput autoscaling policy reads of this replica (placement/autoscaling.py)."""
        costs = await self._load_costs()
        return autoscaling_metrics(self.engine.num_in_flight, self.cfg.max_num_seqs, costs.request_speed)

    async def _load_costs(self) -> LoadCosts:
        try:
            return await asyncio.wait_for(self.engine.load_costs(), 5)
        except Exception:  # the engine is busy starting or has failed: load alone tells
            return LoadCosts()

    async def _report_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.controller_interval_s)
            try:
                snapshot = await self.engine.snapshot()
                report = ReplicaReport(self.replica_id, gauges_of(snapshot), self._status(snapshot, False),
                                       snapshot.policy_state)  # the policy's state travels on its own
                merged = await asyncio.wait_for(self.controller.report.remote(report), 10)
                if merged:
                    await self.engine.import_policy_state(merged)
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
            self.engine.close()
        except Exception:
            pass


def gauges_of(snapshot: EngineSnapshot) -> ReplicaGauges:
    """The figures /metrics renders, read from the engine's snapshot (LLMEngine.snapshot), the shared acceptance
    estimates among them (the policy's state, where it keeps them)."""
    spec, steps, shared = snapshot.spec_decode, snapshot.steps, snapshot.policy_state or {}
    return ReplicaGauges(
        running=snapshot.running, waiting=snapshot.waiting, free_blocks=snapshot.free_blocks,
        num_drafts=spec.num_drafts, num_draft_tokens=spec.num_draft_tokens,
        num_accepted_tokens=spec.num_accepted_tokens,
        by_source={source: (d, t, a) for source, (d, t, a) in sorted(spec.by_source.items())},
        chosen_k=dict(steps.chosen_k), goodput_tokens_per_s=steps.goodput_tokens_per_s,
        step_time_error=steps.prediction_mean_abs_rel_error, prefix_queries=snapshot.prefix_queries,
        prefix_hits=snapshot.prefix_hits, alpha_prior=shared.get("alpha_prior"),
        alpha_prior_later=shared.get("alpha_prior_later"), prior_strength=shared.get("prior_strength"))
