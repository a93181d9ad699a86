"""GoodputRouter: Ray Serve's request router for the LLMServer deployment (`router: goodput`, the default; `router:
default` keeps Serve's power-of-two-choices). It runs in every process that holds a handle to LLMServer (the
ingress), ranks the replicas for each request by its expected latency on each (placement/latency.py), and
hands Serve one rank per replica: Serve sends the request to the first replica of the best rank that has room
(under max_ongoing_requests), so a full replica passes the request to the next.

What it reads: each replica's routing stats (`LLMServer.record_routing_stats`, every
`router_stats_period_s`): its request speed by batch size, prefill cost, and the prefix keys it served; and
Serve's own count of the requests it has sent to each replica and not seen finish, plus the requests this router
has matched to a replica and not yet sent (`InTransit`).

It overrides Serve's private `_fulfill_next_pending_request` and uses four private members of its RequestRouter
there (`_pending_requests_to_fulfill`, `_cancel_routing_task_for_pending_request`, `_record_queue_wait_time`,
`_remove_pending_request_from_indices`); pyproject.toml pins the Ray versions it is tested against.

Serve pickles this module by value into every process that routes: what it shares with the process (the routing
counters) is reached through its module at call time."""
from __future__ import annotations

import logging
import random
import time
from collections import OrderedDict

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from deployments.control import metrics
from deployments.placement.latency import (Choice, PrefillBacklog, PrefixIndex, ReplicaEstimate, RoutedRequest,
                                           rank)
from deployments.wire import ChannelCall, GenerateCall, RoutingStats

logger = logging.getLogger("ray.serve")
REMEMBERED_REQUESTS = 10_000  # request id -> replica, for a retry to avoid the replica its first try died on
IN_TRANSIT_S = 10.0  # a match not sent by then was dropped (its caller was cancelled in between)


def _wire_call(pending_request: PendingRequest | None):
    """A request's one argument, the wire's call it carries (GenerateCall, ChannelCall); None: no argument."""
    if pending_request is None or not pending_request.args or len(pending_request.args) != 1:
        return None
    return pending_request.args[0]


def generate_call(pending_request: PendingRequest | None) -> GenerateCall | None:
    """The call of an LLMServer.generate request; None for other calls (stats, ping, channels)."""
    call = _wire_call(pending_request)
    return call if isinstance(call, GenerateCall) else None


def channel_call(pending_request: PendingRequest | None) -> ChannelCall | None:
    """The call of an LLMServer.channel request (an ingress's channel to the replica it names); None for others."""
    call = _wire_call(pending_request)
    return call if isinstance(call, ChannelCall) else None


class InTransit:
    """Requests matched to a replica and not yet sent to it, per replica. Serve's queue-length cache counts a
    request once it is sent, so requests routed in the same instant (a burst) would all see the same queues and
    pile onto one replica; these fill the gap. A match is closed when Serve sends it (`sent`), when the request
    ends without being sent (`closed`), or, where its caller was cancelled between the match and the send (no
    hook says so), after IN_TRANSIT_S."""

    def __init__(self) -> None:
        self.matched: dict[str, list[tuple[str, float]]] = {}  # replica -> (internal request id, when), oldest first

    def add(self, replica: str, request: str, now: float) -> None:
        self.matched.setdefault(replica, []).append((request, now))

    def sent(self, replica: str) -> None:
        if self.matched.get(replica):
            self.matched[replica].pop(0)

    def closed(self, replica: str, request: str) -> None:
        entries = self.matched.get(replica, [])
        for i, (rid, _) in enumerate(entries):
            if rid == request:
                del entries[i]
                return

    def count(self, replica: str, now: float) -> int:
        entries = [e for e in self.matched.get(replica, []) if now - e[1] <= IN_TRANSIT_S]
        self.matched[replica] = entries
        return len(entries)

    def forget(self, replica: str) -> None:
        self.matched.pop(replica, None)


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
        self.in_transit = InTransit()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # all full: back off before the next try
        replicas = list(candidate_replicas)
        random.shuffle(replicas)  # ties go to a random replica
        if (channel := channel_call(pending_request)) is not None:
            # an ingress's channel to the replica it names, or (that replica gone) nowhere: the caller gives up
            return [[r] for r in replicas if r.replica_id.unique_id == channel.replica_id]
        call = generate_call(pending_request)
        if call is None:  # stats, ping: light calls, to any replica
            return [[r] for r in replicas]
        now = time.monotonic()
        stats = {r.replica_id.unique_id: RoutingStats.from_dict(r.routing_stats) for r in replicas}
        estimates = [ReplicaEstimate.of(rid, self._ongoing(r, now), stats[rid], self.backlog.ahead(rid, now))
                     for r in replicas for rid in [r.replica_id.unique_id]]
        for rid, reported in stats.items():
            if reported is not None:
                self.prefixes.report(rid, reported.prefix_keys, reported.time)
        request = RoutedRequest.of(call, self.routed.get(call.retry_of or ""))
        matched = {e.replica: self.prefixes.matched(e.replica, request.keys, now) for e in estimates}
        choices = rank(request, estimates, matched)
        self.choices[id(pending_request.metadata)] = request.keys, {c.replica: c for c in choices}
        if len(self.choices) > REMEMBERED_REQUESTS:  # requests cancelled before they were routed
            del self.choices[next(iter(self.choices))]
        by_id = {r.replica_id.unique_id: r for r in replicas}
        return [[by_id[c.replica]] for c in choices]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        routed = self.choices.pop(id(pending_request.metadata), None)
        call = generate_call(pending_request)
        if call is None or routed is None:
            return
        keys, choices = routed
        replica = replica_id.unique_id
        choice = choices.get(replica)
        metrics.ROUTING.chosen(replica, choice.reason if choice else "load")  # the module's, not a pickled copy
        self.prefixes.sent(replica, keys)
        self.routed[call.request_id] = replica
        while len(self.routed) > REMEMBERED_REQUESTS:
            self.routed.popitem(last=False)

    def _ongoing(self, replica: RunningReplica, now: float) -> int | None:
        """Requests on the replica as Serve counts them, and the ones matched to it on their way; None: the
        replica's own last report tells."""
        cached = self.replica_queue_len_cache.get(replica.replica_id)
        coming = self.in_transit.count(replica.replica_id.unique_id, now)
        if cached is None:
            return coming or None
        return cached + coming

    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)
        self.in_transit.sent(replica_id.unique_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        rid = replica_id.unique_id
        self.in_transit.closed(rid, internal_request_id)  # ended before it was sent (a send that failed)
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
                rid, now = replica.replica_id.unique_id, time.monotonic()
                self.in_transit.add(rid, request_metadata.internal_request_id, now)
                _, choices = self.choices.get(id(request_metadata), ((), {}))
                choice = choices.get(rid)
                if choice is not None:
                    self.backlog.add(rid, choice.prefill_s, now, request_metadata.internal_request_id)
                return

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.prefixes.forget(replica_id.unique_id)
        self.backlog.forget(replica_id.unique_id)
        self.in_transit.forget(replica_id.unique_id)
