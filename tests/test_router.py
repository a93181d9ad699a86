"""GoodputRouter, the class Serve runs, driven through Serve's own request-router entry point
(`_choose_replica_for_request`) over Serve's in-memory replica stand-ins (ray.serve._private.test_utils): no
cluster, no timing. The ranking itself is tested apart in test_routing.py."""
import asyncio

import pytest

pytest.importorskip("ray.serve")
from ray.serve._private.common import DeploymentHandleSource, RequestMetadata  # noqa: E402
from ray.serve._private.request_router.common import PendingRequest  # noqa: E402
from ray.serve._private.test_utils import FAKE_REPLICA_DEPLOYMENT_ID, FakeRunningReplica  # noqa: E402

from deployments.placement import router as router_module  # noqa: E402
from deployments.placement.latency import prefix_keys, prefix_text  # noqa: E402
from deployments.placement.router import GoodputRouter  # noqa: E402
from deployments.wire import GenerateCall, RoutingStats  # noqa: E402
from smartspec.types.sampling_params import SamplingParams  # noqa: E402

SYSTEM = "you answer as a patient teacher would, step by step. " * 40


class Replica(FakeRunningReplica):
    """Serve's stand-in, with the routing stats a real replica's record_routing_stats would have sent."""

    def __init__(self, name: str, stats: RoutingStats | None = None) -> None:
        super().__init__(name)
        self.stats = stats
        self.set_queue_len_response(0)

    @property
    def routing_stats(self) -> dict:
        return self.stats.as_dict() if self.stats is not None else {}


def make_router(replicas: list[Replica]) -> GoodputRouter:
    router = GoodputRouter(FAKE_REPLICA_DEPLOYMENT_ID, DeploymentHandleSource.UNKNOWN,
                           use_replica_queue_len_cache=True)
    router.initialize_state()
    router.update_replicas(replicas)
    return router


def pending(call: GenerateCall, internal_id: str = "http-1") -> PendingRequest:
    return PendingRequest(args=[call], kwargs={}, metadata=RequestMetadata(
        request_id=call.request_id, internal_request_id=internal_id, call_method="generate", is_streaming=True))


def chat_call(*turns: str, retry_of: str | None = None) -> GenerateCall:
    messages = [("system", SYSTEM), *(("user", t) for t in turns)]
    return GenerateCall(SamplingParams(max_tokens=32), messages=[{"role": r, "content": c} for r, c in messages],
                        prefix_text=prefix_text(messages, None), retry_of=retry_of)


def stats_holding(call: GenerateCall) -> RoutingStats:
    return RoutingStats(0.0, 0, 16, prefix_keys=prefix_keys(call.prefix_text))


async def route(router: GoodputRouter, request: PendingRequest):
    """Serve's path for one request: choose, send, routed."""
    replica = await asyncio.wait_for(router._choose_replica_for_request(request), 30)
    router.on_send_request(replica.replica_id)
    router.on_request_routed(request, replica.replica_id, None)
    return replica.replica_id.unique_id


def test_a_request_goes_to_the_replica_holding_its_prefix_and_its_retry_elsewhere():
    async def run():
        first = chat_call("hello")
        router = make_router([Replica("other", RoutingStats(0.0, 0, 16)), Replica("holder", stats_holding(first))])
        assert await route(router, pending(chat_call("hello", "and then?"))) == "holder"
        sent = chat_call("hi")
        assert await route(router, pending(sent, "http-2")) == "holder"
        # the retry avoids the replica its first try was sent to
        assert await route(router, pending(chat_call("hi", retry_of=sent.request_id), "http-3")) == "other"

    asyncio.run(run())


def test_n_choices_of_one_http_request_are_each_routed():
    """Every handle call made while serving one HTTP request shares its internal id (n > 1, a retry): each must
    get its own replica, none left waiting."""
    async def run():
        router = make_router([Replica("a"), Replica("b")])
        calls = [GenerateCall(SamplingParams(max_tokens=8, seed=i), prompt="p", prefix_text="p") for i in range(3)]
        chosen = await asyncio.wait_for(asyncio.gather(*(router._choose_replica_for_request(pending(c, "same"))
                                                         for c in calls)), 30)
        assert len(chosen) == 3

    asyncio.run(run())


def test_a_match_never_sent_stops_counting_and_a_sent_one_counts_once(monkeypatch):
    """A request matched to a replica counts toward its load until Serve sends it (then Serve's own queue length
    counts it); a match whose caller was cancelled before the send is dropped after IN_TRANSIT_S, not kept."""
    clock = [1000.0]
    monkeypatch.setattr(router_module.time, "monotonic", lambda: clock[0])
    call = GenerateCall(SamplingParams(max_tokens=8), prompt="p", prefix_text="p")

    async def run():
        router = make_router([Replica("a"), Replica("b")])
        chosen = await asyncio.wait_for(router._choose_replica_for_request(pending(call)), 30)
        before = router.replica_queue_len_cache.get(chosen.replica_id) or 0
        assert router._ongoing(chosen, clock[0]) == before + 1  # matched, never sent: its caller went away
        clock[0] += router_module.IN_TRANSIT_S + 1
        assert router._ongoing(chosen, clock[0]) in (before, None)
        sent = await asyncio.wait_for(router._choose_replica_for_request(pending(call, "http-2")), 30)
        cached = router.replica_queue_len_cache.get(sent.replica_id) or 0
        router.on_send_request(sent.replica_id)  # Serve's cache now counts it; the match no longer does
        assert router._ongoing(sent, clock[0]) == cached + 1
        router.on_request_completed(sent.replica_id, "http-2")
        assert router.in_transit.count(sent.replica_id.unique_id, clock[0]) == 0

    asyncio.run(run())
