"""The draft model in its own Ray actor, behind the engine's narrow Proposer interface.

The replica sends, per step, each speculating request's new target tokens (a delta against what the actor has
seen) and k; the actor mirrors the requests, runs the in-process DraftModelProposer on the mirrors and returns
the drafts. If the actor dies, Ray restarts it (max_restarts=-1); meanwhile `available` is False and the engine
plans k = 0, so requests keep going, unchanged, at plain-decoding speed. A restarted actor knows no request: it
says so, and the replica resends those requests whole."""
from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field, replace

import ray
import torch

from smartspec.spec_decode.config import SpeculativeConfig
from smartspec.spec_decode.factory import DraftRuntime, make_draft_proposer
from smartspec.spec_decode.proposer import Proposal, Proposer
from smartspec.types.request import Request
from smartspec.types.sampling_params import SamplingParams
from smartspec.types.tree import TokenTree

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftRow:
    """One speculating request's part of a draft call: its target tokens from `offset` on (offset 0: the whole
    request, the first `prompt_len` its prompt), its sampling params (a sampled request drafts with a generator of
    its own) and k."""
    request_id: str
    offset: int
    new_tokens: list[int]
    prompt_len: int
    params: SamplingParams
    k: int


@dataclass(frozen=True)
class DraftBatch:
    """A step's draft call: the rows, and the requests the replica finished since the last call."""
    rows: list[DraftRow]
    released: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Draft:
    """One request's draft: its chain's tokens and their draft probabilities (sampled requests), or its tree."""
    tokens: list[int]
    probs: torch.Tensor | None = None
    tree: TokenTree | None = None


NO_DRAFT = Draft([])


@dataclass(frozen=True)
class DraftReply:
    incarnation: str  # which start of the actor answered: a restarted one knows only whole requests
    drafts: dict[str, Draft]  # by request id
    unknown: list[str]  # requests sent as a delta the actor has no mirror of: send them whole next time
    catchup_tokens: int  # tokens the draft read before drafting (its catch-up), for the cost model


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

    def propose(self, batch: DraftBatch) -> DraftReply:
        """Drafts for the batch's rows, each request's mirror brought up to its tokens first."""
        self.release_many(batch.released)
        requests, ks, unknown = [], [], []
        for row in batch.rows:
            mirror = self.mirrors.get(row.request_id)
            if row.offset == 0:
                if mirror is None:
                    mirror = self.mirrors[row.request_id] = self._mirror(row.request_id,
                                                                         row.new_tokens[:row.prompt_len], row.params)
            elif mirror is None or row.offset > mirror.num_tokens:
                unknown.append(row.request_id)
                continue
            mirror.token_ids[row.offset:] = row.new_tokens  # in place: the part before offset is as it was
            requests.append(mirror)
            ks.append(row.k)
        proposal = self.proposer.propose(requests, ks) if requests else Proposal([], [])
        trees = proposal.trees or [None] * len(requests)
        drafts = {r.request_id: Draft(t, q, tree)
                  for r, t, q, tree in zip(requests, proposal.tokens, proposal.probs, trees)}
        return DraftReply(self.incarnation, drafts, unknown, proposal.catchup_tokens)

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
        rows = []
        for req, k in zip(requests, ks):
            if k <= 0:
                continue
            offset = self._sent.get(req.request_id, 0)
            rows.append(DraftRow(req.request_id, offset, req.token_ids[offset:], req.num_prompt_tokens, req.params,
                                 k))
        batch, self._released = DraftBatch(rows, self._released), []
        try:
            reply: DraftReply = ray.get(self.actor.propose.remote(batch), timeout=self.timeout_s)
        except Exception as exc:
            self._alive = False
            self.failures += 1
            self._sent.clear()
            if isinstance(exc, ray.exceptions.GetTimeoutError):
                # alive but stuck: restart it, so that no request's draft state outlives what this side knows
                ray.kill(self.actor, no_restart=False)
            self._ready_ref = self.actor.ready.remote()
            raise
        if reply.incarnation != self.incarnation:  # restarted between two calls: it knows only full sends
            self.incarnation = reply.incarnation
            self._sent.clear()
        for rid in reply.unknown:
            self._sent.pop(rid, None)
        for req in requests:
            if req.request_id in reply.drafts:
                self._sent[req.request_id] = req.num_tokens
        drafts = [reply.drafts.get(r.request_id, NO_DRAFT) for r in requests]
        trees = None
        if any(d.tree is not None for d in drafts):
            trees = [d.tree if d.tree is not None else TokenTree([], [], []) for d in drafts]
        return Proposal([d.tokens for d in drafts], [d.probs for d in drafts], trees, reply.catchup_tokens)

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
