"""GoodputRouter: Ray Serve's request router for the LLMServer deployment (`router: goodput`, the default; `router:
default` keeps Serve's power-of-two-choices). It runs in every process that holds a handle to LLMServer (the
ingress), ranks the replicas for each request by its expected latency on each (deployments/routing.py), and
hands Serve one rank per replica: Serve sends the request to the first replica of the best rank that has room
(under max_ongoing_requests), so a full replica passes the request to the next.

What it reads: each replica's routing stats (`LLMServer.record_routing_stats`, every
`router_stats_period_s`): its request speed by batch size, prefill cost, and the prefix keys it served; and
Serve's own count of the requests it has sent to each replica and not seen finish.

Serve pickles this module by value into every process that routes: what it shares with the process (the routing
counters) is reached through its module at call time."""
from __future__ import annotations

import logging
import random
import time
from collections import Counter, OrderedDict

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from deployments import metrics
from deployments.routing import Choice, PrefillBacklog, PrefixIndex, ReplicaEstimate, RoutedRequest, rank

logger = logging.getLogger("ray.serve")
REMEMBERED_REQUESTS = 10_000  # request id -> replica, for a retry to avoid the replica its first try died on


def generate_body(pending_request: PendingRequest | None) -> dict | None:
    """The body of an LLMServer.generate call (a dict with messages or a prompt); None for other calls."""
    if pending_request is None or pending_request.args is None or len(pending_request.args) != 1:
        return None
    body = pending_request.args[0]
    return body if isinstance(body, dict) and ("messages" in body or "prompt" in body) else None


class GoodputRouter(RequestRouter):
    """Ranks replicas by expected latency (prefix affinity, queue, request speed); exact per-request routing:
    a replica chosen for one request is never handed to another pending one."""

    def initialize_state(self, recent_s: float = 30.0) -> None:
        logger.info("goodput router for %s", self._deployment_id)
        self.prefixes = PrefixIndex(recent_s)
        self.routed: OrderedDict[str, str] = OrderedDict()  # request id -> replica it was sent to
        # id of a request's metadata -> (its prefix keys, replica -> its estimate there), read once it is routed
        self.choices: dict[int, tuple[list[int], dict[str, Choice]]] = {}
        self.backlog = PrefillBacklog()
        # requests this router has handed each replica and not seen complete, counted when the replica is chosen:
        # Serve's queue-length cache counts a request only once it is sent, so requests routed in the same instant
        # (a burst) would all see the same queues and pile onto one replica
        self.assigned: Counter[str] = Counter()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # all full: back off before the next try
        replicas = list(candidate_replicas)
        random.shuffle(replicas)  # ties go to a random replica
        body = generate_body(pending_request)
        if body is None:  # stats, ping: light calls, to any replica
            return [[r] for r in replicas]
        now = time.monotonic()
        estimates = [ReplicaEstimate.of(r.replica_id.unique_id, self._ongoing(r), r.routing_stats,
                                        self.backlog.ahead(r.replica_id.unique_id, now)) for r in replicas]
        by_id = {r.replica_id.unique_id: r for r in replicas}
        for r in replicas:
            stats = r.routing_stats or {}
            if "prefix_keys" in stats:
                self.prefixes.report(r.replica_id.unique_id, stats["prefix_keys"], stats.get("time"))
        request = RoutedRequest.of(body, self.routed.get(body.get("retry_of") or ""))
        matched = {e.replica: self.prefixes.matched(e.replica, request.keys, now) for e in estimates}
        choices = rank(request, estimates, matched)
        self.choices[id(pending_request.metadata)] = request.keys, {c.replica: c for c in choices}
        if len(self.choices) > REMEMBERED_REQUESTS:  # requests cancelled before they were routed
            del self.choices[next(iter(self.choices))]
        return [[by_id[c.replica]] for c in choices]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        routed = self.choices.pop(id(pending_request.metadata), None)
        body = generate_body(pending_request)
        if body is None or routed is None:
            return
        keys, choices = routed
        replica = replica_id.unique_id
        choice = choices.get(replica)
        metrics.ROUTING.chosen(replica, choice.reason if choice else "load")  # the module's, not a pickled copy
        self.prefixes.sent(replica, keys)
        if body.get("request_id"):
            self.routed[body["request_id"]] = replica
            while len(self.routed) > REMEMBERED_REQUESTS:
                self.routed.popitem(last=False)

    def _ongoing(self, replica: RunningReplica) -> int | None:
        cached = self.replica_queue_len_cache.get(replica.replica_id)
        mine = self.assigned.get(replica.replica_id.unique_id, 0)
        if cached is None:
            return mine or None  # None: the replica's own last report tells
        return max(cached, mine)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        rid = replica_id.unique_id
        if self.assigned.get(rid, 0) > 0:
            self.assigned[rid] -= 1
        self.backlog.done(rid, time.monotonic(), internal_request_id)

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata=None) -> None:
        """The replica chosen for a request goes to that very request. (Serve's own match is by internal request
        id, which every handle call made while serving one HTTP request shares: n choices, a retry; it would leave
        all but one of them unrouted.)"""
        for pending in self._pending_requests_to_fulfill:
            if pending.metadata is request_metadata and not pending.future.done():
                self._cancel_routing_task_for_pending_request(pending)
                self._record_queue_wait_time(pending)
                pending.future.set_result(replica)
                self._remove_pending_request_from_indices(pending)
                # counted now, not once sent: the next request of a burst is routed before this one is sent
                rid = replica.replica_id.unique_id
                self.assigned[rid] += 1
                _, choices = self.choices.get(id(request_metadata), ((), {}))
                choice = choices.get(rid)
                if choice is not None:
                    self.backlog.add(rid, choice.prefill_s, time.monotonic(), request_metadata.internal_request_id)
                return

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.prefixes.forget(replica_id.unique_id)
        self.backlog.forget(replica_id.unique_id)
        self.assigned.pop(replica_id.unique_id, None)
