"""The draft model in its own Ray actor, behind the engine's narrow Proposer interface.

The replica sends, per step, each speculating request's new target tokens (a delta against what the actor has
seen) and k; the actor mirrors the requests, runs the in-process DraftModelProposer on the mirrors and returns
the drafts. If the actor dies, Ray restarts it (max_restarts=-1); meanwhile `available` is False and the engine
plans k = 0, so requests keep going, unchanged, at plain-decoding speed. A restarted actor knows no request: it
says so, and the replica resends those requests whole."""
from __future__ import annotations

import logging
import uuid
from dataclasses import replace

import ray
import torch

from smartspec.spec_decode.config import SpeculativeConfig
from smartspec.spec_decode.factory import DraftRuntime, make_draft_proposer
from smartspec.spec_decode.proposer import Proposal, Proposer
from smartspec.types.request import Request
from smartspec.types.sampling_params import SamplingParams
from smartspec.types.tree import TokenTree

logger = logging.getLogger(__name__)


def start_draft_actor(name: str | None, spec: SpeculativeConfig, runtime: DraftRuntime, target_model: str,
                      num_threads: int | None) -> RemoteDraftProposer:
    """The draft model of a single-method draft_model config in its own (restarting) Ray actor, with this
    replica's runtime options; what the replica's engine uses as its draft proposer."""
    from smartspec.models import load_model

    # a mismatched pair is a configuration error: say so now, not in an actor restarting forever
    if load_model(spec.model, weights=False).tokenizer.get_vocab() != runtime.target_tokenizer.get_vocab():
        raise ValueError(f"draft model {spec.model!r} does not share the tokenizer of {target_model!r}; draft and "
                         "target must use the same vocabulary")
    options = {"num_cpus": spec.draft_num_cpus, "max_restarts": -1, "max_task_retries": 0}
    if name is not None:
        options["name"] = name
    actor = ray.remote(DraftWorker).options(**options).remote(
        spec.draft_only(), replace(runtime, target_tokenizer=None), target_model, num_threads)
    return RemoteDraftProposer(actor)


class DraftWorker:
    def __init__(self, spec: SpeculativeConfig, runtime: DraftRuntime, target_model: str,
                 num_threads: int | None) -> None:
        """spec: a single-method draft_model config (chains, or trees); runtime: the replica's, without its
        tokenizer (the actor loads the target's by name)."""
        from smartspec.models import load_model

        if num_threads:
            torch.set_num_threads(num_threads)
        target_tokenizer = load_model(target_model, weights=False).tokenizer
        self.device = runtime.device
        self.proposer = make_draft_proposer(spec, replace(runtime, target_tokenizer=target_tokenizer))
        self.incarnation = uuid.uuid4().hex  # a restarted actor is a new incarnation with no request state
        self.mirrors: dict[str, Request] = {}

    def ready(self) -> str:
        return self.incarnation

    def propose(self, batch: list[tuple], released: list[str]) -> dict:
        """batch: (request_id, offset, new_tokens, prompt_len, params, k) per request; new_tokens continue the
        request's tokens from offset (offset 0: the whole request)."""
        self.release_many(released)
        requests, ks, unknown = [], [], []
        for rid, offset, new_tokens, prompt_len, params, k in batch:
            mirror = self.mirrors.get(rid)
            if offset == 0:
                if mirror is None:
                    mirror = self.mirrors[rid] = self._mirror(rid, new_tokens[:prompt_len], params)
            elif mirror is None or offset > mirror.num_tokens:
                unknown.append(rid)
                continue
            mirror.token_ids = mirror.token_ids[:offset] + list(new_tokens)
            requests.append(mirror)
            ks.append(k)
        proposal = self.proposer.propose(requests, ks) if requests else Proposal([], [])
        trees = proposal.trees or [None] * len(requests)
        drafts = {r.request_id: (t, q, tree) for r, t, q, tree in zip(requests, proposal.tokens, proposal.probs, trees)}
        return {"incarnation": self.incarnation, "drafts": drafts, "unknown": unknown,
                "catchup": proposal.catchup_tokens}

    def _mirror(self, rid: str, prompt: list[int], params: SamplingParams) -> Request:
        generator = None
        if not params.greedy:  # any randomness keeps the output lossless; a seed keeps it reproducible
            # on the draft's device: a draw takes its generator's device
            generator = torch.Generator(device=self.device).manual_seed(params.seed if params.seed is not None
                                                                        else torch.seed() % 2**63)
        return Request(rid, list(prompt), params, generator)

    def release(self, request_id: str) -> None:
        self.mirrors.pop(request_id, None)
        self.proposer.release(request_id)

    def release_many(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.release(rid)

    def num_free_blocks(self) -> int:
        return self.proposer.blocks.num_free


class RemoteDraftProposer(Proposer):
    method = "draft_model"

    def __init__(self, actor, timeout_s: float = 120.0, startup_timeout_s: float = 900.0) -> None:
        self.actor = actor
        self.timeout_s = timeout_s
        self._sent: dict[str, int] = {}  # request -> target tokens the actor has been sent
        self._released: list[str] = []
        self._alive = False
        self.failures = 0
        self._ready_ref = actor.ready.remote()
        try:  # the replica is ready when its draft is; a draft that fails to start only costs speculation
            self.incarnation = ray.get(self._ready_ref, timeout=startup_timeout_s)
            self._alive = True
        except Exception:
            logger.exception("draft actor did not start; running without speculation until it does")
            self.incarnation = None

    @property
    def available(self) -> bool:
        if self._alive:
            return True
        ready, _ = ray.wait([self._ready_ref], timeout=0)
        if not ready:
            return False
        try:
            self.incarnation = ray.get(self._ready_ref)
        except Exception:  # still down: ask again (Ray queues the call until the restarted actor is up)
            self._ready_ref = self.actor.ready.remote()
            return False
        logger.warning("draft actor is back (incarnation %s); speculation resumes", self.incarnation)
        self._sent.clear()
        self._alive = True
        return True

    @property
    def draft_available(self) -> bool:
        return self.available

    def propose(self, requests: list[Request], ks: list[int], methods: list[str] | None = None) -> Proposal:
        batch = []
        for req, k in zip(requests, ks):
            if k <= 0:
                continue
            offset = self._sent.get(req.request_id, 0)
            batch.append((req.request_id, offset, req.token_ids[offset:], req.num_prompt_tokens, req.params, k))
        released, self._released = self._released, []
        try:
            reply = ray.get(self.actor.propose.remote(batch, released), timeout=self.timeout_s)
        except Exception as exc:
            self._alive = False
            self.failures += 1
            self._sent.clear()
            if isinstance(exc, ray.exceptions.GetTimeoutError):
                # alive but stuck: restart it, so that no request's draft state outlives what this side knows
                ray.kill(self.actor, no_restart=False)
            self._ready_ref = self.actor.ready.remote()
            raise
        if reply["incarnation"] != self.incarnation:  # restarted between two calls: it knows only full sends
            self.incarnation = reply["incarnation"]
            self._sent.clear()
        for rid in reply["unknown"]:
            self._sent.pop(rid, None)
        drafts = reply["drafts"]
        for req in requests:
            if req.request_id in drafts:
                self._sent[req.request_id] = req.num_tokens
        replies = [drafts.get(r.request_id, ([], None, None)) for r in requests]
        trees = None
        if any(tree is not None for _, _, tree in replies):
            trees = [tree if tree is not None else TokenTree([], [], []) for _, _, tree in replies]
        return Proposal([t for t, _, _ in replies], [q for _, q, _ in replies], trees, reply["catchup"])

    def release(self, request_id: str) -> None:
        if self._sent.pop(request_id, None) is not None:
            self._released.append(request_id)
            if len(self._released) >= 64:  # idle speculation: do not let finished requests pile up in the draft
                try:
                    self.actor.release_many.remote(self._released)
                    self._released = []
                except Exception:
                    pass

    def close(self) -> None:
        try:
            ray.kill(self.actor)
        except Exception:
            pass
