"""The goodput router's ranking (placement/latency.py), the autoscaling rule (placement/autoscaling.py) and the
failover rules (placement/failover.py): pure logic, no Ray cluster, no timing."""
import asyncio
from types import SimpleNamespace

import pytest
from ray.exceptions import ActorDiedError

from deployments.app import llm_server_options
from deployments.control.config import AppConfig
from deployments.placement.autoscaling import (autoscaling_metrics, desired_replicas, goodput_policy, merged_table,
                                               speed_at)
from deployments.placement.failover import FailoverStream, GenerationFailed, NoReplicaInTime, may_retry
from deployments.placement.latency import (
    CHUNK_CHARS,
    PrefillBacklog,
    PrefixIndex,
    ReplicaEstimate,
    RoutedRequest,
    ServedPrefixes,
    pooled,
    prefix_keys,
    prefix_text,
    rank,
)
from deployments.wire import Accepted, Delta, GenerateCall, Refused, Restart, RoutingStats
from smartspec.types.sampling_params import SamplingParams

SYSTEM = "".join(f"rule {i}: answer in the voice of a patient teacher. " for i in range(80))  # ~4,000 chars


def chat(system: str, *turns: str) -> GenerateCall:
    messages = [("system", system), *(("user", t) for t in turns)]
    return GenerateCall(SamplingParams(max_tokens=32), messages=[{"role": r, "content": c} for r, c in messages],
                        prefix_text=prefix_text(messages, None))


def completion(prompt: str | list[int], until_context_end: bool = False, **params) -> GenerateCall:
    return GenerateCall(SamplingParams(**params), prompt=prompt, prefix_text=prefix_text(None, prompt),
                        until_context_end=until_context_end)


def stats(**values) -> RoutingStats:
    return RoutingStats.from_dict({"time": 0.0, "ongoing": 0, "max_num_seqs": 16, **values})


# ---- prefix keys ---------------------------------------------------------------------------------------------
def test_prefix_keys_are_chained_over_full_chunks():
    a = prefix_keys("x" * 1000)
    assert len(a) == 1000 // CHUNK_CHARS  # the partial tail has no key
    assert prefix_keys("x" * 1000) == a  # stable (not Python's salted hash)
    b = prefix_keys("x" * 600 + "y" * 400)
    assert b[:2] == a[:2] and b[2:] != a[2:]  # equal up to the first differing chunk, different from it on
    c = prefix_keys("y" * 256 + "x" * 744)
    assert c[1:] != a[1:]  # a key stands for everything before it, not for its chunk alone


def test_a_conversations_next_turn_shares_its_keys_and_another_system_prompt_does_not():
    first = prefix_keys(chat(SYSTEM, "hello").prefix_text)
    second = prefix_keys(chat(SYSTEM, "hello", "and then?").prefix_text)
    other = prefix_keys(chat(SYSTEM.replace("teacher", "pirate"), "hello").prefix_text)
    assert len(first) >= 15 and second[:len(first) - 1] == first[:-1]
    assert other[0] != first[0]
    assert prefix_text(None, [1, 2, 3]) == "1 2 3"
    assert prefix_text([("user", "hi")], None) != prefix_text([("system", "hi")], None)  # roles count


def test_served_prefixes_keep_the_most_recent():
    served = ServedPrefixes(3)
    served.add([1, 2, 3])
    served.add([4, 1])
    assert served.snapshot() == [3, 4, 1]


def test_a_replicas_routing_ledger_reports_what_it_served():
    """What the router reads of a replica: the prefix keys of its prompts, characters per prompt token, the
    prefix memory sized to the KV cache, a request's mean time, and the engine's load costs."""
    from deployments.placement.ledger import RoutingLedger
    from smartspec.types.snapshot import LoadCosts

    ledger = RoutingLedger(capacity=4096)
    text = "x" * (3 * CHUNK_CHARS)
    ledger.accepted(text, 192)
    ledger.finished(2.0)
    ledger.finished(4.0)
    stats = ledger.stats(3, 8, LoadCosts({1: 20.0}, 1e-3), kv_capacity_tokens=6400)
    assert (stats.ongoing, stats.max_num_seqs, stats.request_speed, stats.prefill_s_per_token) == (3, 8, {1: 20.0},
                                                                                                    1e-3)
    assert stats.chars_per_token == 4.0 and stats.prefix_keys == prefix_keys(text) and len(stats.prefix_keys) == 3
    assert stats.request_s == pytest.approx(0.9 * 2.0 + 0.1 * 4.0)
    assert ledger.served.capacity == 6400 * 4 // CHUNK_CHARS  # as many keys as the KV cache holds tokens
    assert RoutingLedger().stats(0, 8, LoadCosts(), 6400).chars_per_token is None  # nothing served yet


def test_prefix_index_matches_leading_keys_from_reports_and_recent_sends():
    index = PrefixIndex(recent_s=10)
    index.report("a", [1, 2, 3], reported_at=1.0)
    assert index.matched("a", [1, 2, 9, 3]) == 2  # leading keys only
    assert index.matched("b", [1, 2]) == 0
    index.sent("b", [1, 2, 5], now=100.0)
    assert index.matched("b", [1, 2, 5, 6], now=105.0) == 3
    assert index.matched("b", [1, 2, 5], now=111.0) == 0  # a send is believed for recent_s, then reports tell
    index.report("a", [7], reported_at=2.0)  # a new report replaces the old one (evictions show)
    assert index.matched("a", [1]) == 0 and index.matched("a", [7]) == 1
    index.forget("a")
    assert index.matched("a", [7]) == 0


# ---- ranking -------------------------------------------------------------------------------------------------
def estimates(ongoing_a: int, ongoing_b: int, **values) -> list[ReplicaEstimate]:
    return [ReplicaEstimate.of("a", ongoing_a, stats(**values)), ReplicaEstimate.of("b", ongoing_b, stats(**values))]


def test_the_replica_holding_the_prefix_ranks_first_at_equal_load():
    request = RoutedRequest.of(chat(SYSTEM, "hello"))
    held = len(request.keys)
    choices = rank(request, estimates(1, 1), {"a": 0, "b": held})
    assert [c.replica for c in choices] == ["b", "a"]
    assert choices[0].reason == "affinity" and choices[0].cached_tokens > 0 and choices[1].reason == "load"
    assert choices[0].latency_s < choices[1].latency_s


def test_a_queued_replica_loses_its_affinity_and_a_free_one_wins_on_load():
    request = RoutedRequest.of(chat(SYSTEM, "hello"))
    values = {"max_num_seqs": 4, "request_speed": {1: 20.0, 2: 18.0, 4: 15.0}, "prefill_s_per_token": 1e-3}
    # b is 8 requests deep (4 of them queued): waiting for a slot costs more than the ~1,000-token prefill
    choices = rank(request, estimates(0, 8, **values), {"a": 0, "b": len(request.keys)})
    assert choices[0].replica == "a" and choices[0].reason == "load"
    choices = rank(request, estimates(3, 1, **values), {})
    assert choices[0].replica == "b" and choices[0].reason == "load"


def test_the_speed_table_prices_a_bigger_batch_and_noisy_fits_are_pooled():
    request = RoutedRequest.of(completion("short", max_tokens=64))
    table = stats(request_speed={1: 40.0, 2: 35.0, 4: 30.0})
    busy, idle = ReplicaEstimate.of("busy", 3, table), ReplicaEstimate.of("idle", 1, table)
    assert rank(request, [busy, idle], {})[0].replica == "idle"  # 64 tokens at 35 tok/s beat 64 at 30
    assert idle.speed(3) == pytest.approx(32.5) and idle.speed(64) == 30.0 and idle.speed(1) == 40.0
    fast = ReplicaEstimate.of("fast", 2, stats(request_speed={1: 40.0, 2: 30.0}, prefill_s_per_token=1e-3))
    slow = ReplicaEstimate.of("slow", 2, stats(request_speed={1: 12.0}, prefill_s_per_token=3e-3))
    fresh = ReplicaEstimate.of("fresh", 0, None)
    a, b, c = pooled([fast, slow, fresh])
    assert a.request_speed == b.request_speed == c.request_speed == {1: 26.0, 2: 30.0}
    assert a.prefill_s_per_token == c.prefill_s_per_token == pytest.approx(2e-3)


def test_a_burst_of_first_turns_is_spread_and_a_burst_of_next_turns_stays_with_its_prefixes():
    """Eight new conversations at once go four and four (each adds its prefill to its replica's account); their
    next turns, all at once, go back where their prefixes are (each adds little)."""
    backlog, home = PrefillBacklog(), {}
    systems = [SYSTEM.replace("teacher", f"teacher {topic}") for topic in range(8)]
    for turn in (("hello",), ("hello", "and then?")):
        for i, system in enumerate(systems):
            request = RoutedRequest.of(chat(system, *turn))
            matched = {home[i]: len(request.keys) - 1} if i in home else {}
            first = rank(request, [ReplicaEstimate.of(r, 0, stats(prefill_s_per_token=2e-3),
                                                      backlog.ahead(r, now=0.0)) for r in ("a", "b")], matched)[0]
            backlog.add(first.replica, first.prefill_s, now=0.0)
            assert home.setdefault(i, first.replica) == first.replica
    assert sorted(home.values()) == ["a"] * 4 + ["b"] * 4


def test_the_prefill_backlog_drains_in_real_time():
    backlog = PrefillBacklog()
    backlog.add("a", 3.0, now=10.0)
    backlog.add("a", 1.0, now=11.0)  # 2 s left of the first, plus 1
    assert backlog.ahead("a", now=11.0) == 3.0 and backlog.ahead("a", now=13.5) == 0.5
    assert backlog.ahead("a", now=20.0) == 0.0 and backlog.ahead("b", now=20.0) == 0.0
    backlog.add("b", 5.0, now=30.0, key="r1")
    backlog.add("b", 2.0, now=30.0, key="r2")
    backlog.done("b", now=31.0, key="r1")  # finished early: only r2's prefill can still be queued
    assert backlog.ahead("b", now=31.0) == 2.0
    backlog.done("b", now=31.0, key="r2")
    assert backlog.ahead("b", now=31.0) == 0.0


def test_a_retry_avoids_the_replica_its_first_try_failed_on():
    request = RoutedRequest.of(chat(SYSTEM, "hello"), avoid="b")
    choices = rank(request, estimates(5, 0), {"b": len(request.keys)})
    assert [c.replica for c in choices] == ["a", "b"] and choices[0].reason == "retry"


def test_a_missing_report_counts_as_a_fresh_replica():
    e = ReplicaEstimate.of("a", None, stats(ongoing=3))
    assert e.ongoing == 3 and e.request_speed is None and e.speed(1) > e.speed(8)
    assert ReplicaEstimate.of("a", None, None).ongoing == 0
    assert RoutedRequest.of(completion("x", until_context_end=True)).output_tokens > 0
    assert RoutedRequest.of(completion([1, 2, 3])).prompt_tokens == 3


def test_routing_stats_cross_serve_as_plain_values():
    reported = RoutingStats(1.5, 2, 8, {1: 20.0, 4: 12.0}, 1e-3, 3.5, 4.0, [7, 8])
    plain = reported.as_dict()
    assert all(isinstance(v, (int, float, list, dict, type(None))) for v in plain.values())
    assert RoutingStats.from_dict(plain) == reported and RoutingStats.from_dict({}) is None


# ---- autoscaling ---------------------------------------------------------------------------------------------
TABLE = {1: 20.0, 2: 18.0, 4: 14.0, 8: 9.0}


def test_speed_beyond_max_num_seqs_is_the_full_batch_shared():
    assert speed_at(TABLE, 8, 8) == 9.0
    assert speed_at(TABLE, 16, 8) == pytest.approx(4.5)
    assert speed_at(TABLE, 3, 8) == pytest.approx(16.0)


def test_replicas_scale_up_when_requests_slow_below_the_fraction_and_down_when_one_fewer_keeps_it():
    kw = dict(table=TABLE, max_num_seqs=8, max_replicas=4, min_speed_fraction=0.5, target_ongoing_requests=8)
    assert desired_replicas(4, current=1, **kw) == 1  # 14 tok/s >= 10
    assert desired_replicas(8, current=1, **kw) == 2  # 9 < 10: two replicas at 4 each
    assert desired_replicas(30, current=2, **kw) == 4  # ceil(30/4) = 8 each: still short, the most allowed
    assert desired_replicas(3, current=2, **kw) == 1  # back down
    assert desired_replicas(0, current=2, **kw) == 0  # Serve keeps min_replicas
    assert desired_replicas(17, None, 8, 1, 4, 0.5, target_ongoing_requests=8) == 3  # no fit yet: Serve's rule


def test_the_policy_reads_what_the_replicas_report():
    reports = {"r1": autoscaling_metrics(6, 8, TABLE), "r2": autoscaling_metrics(4, 8, {1: 22.0, 8: 11.0})}
    metrics = {name: {rid: m.get(name) for rid, m in reports.items()} for name in set().union(*reports.values())}
    assert merged_table(metrics)[1] == 21.0 and merged_table(metrics)[2] == 18.0
    config = SimpleNamespace(policy=SimpleNamespace(policy_kwargs={"min_speed_fraction": 0.5}),
                             get_target_ongoing_requests=lambda: 8)
    ctx = SimpleNamespace(aggregated_metrics=metrics, config=config, total_num_requests=10, current_num_replicas=2,
                          capacity_adjusted_max_replicas=3)
    n, state = goodput_policy(ctx)
    assert n == 2 and state["requests"] == 10  # 5 each: 12.75 tok/s >= 10.5


def test_the_served_config_wires_router_autoscaling_and_drain():
    cfg = AppConfig.model_validate({"speculation": None, "autoscaling": {"min_replicas": 1, "max_replicas": 3,
                                                                         "downscale_delay_s": 15}})
    options = llm_server_options(cfg)
    assert options["request_router_config"]["request_router_class"] == "deployments.placement.router:GoodputRouter"
    assert options["autoscaling_config"]["policy"]["policy_function"] == "deployments.placement.autoscaling:goodput_policy"
    assert options["autoscaling_config"]["downscale_delay_s"] == 15 and options["graceful_shutdown_timeout_s"] == 120
    plain = llm_server_options(AppConfig.model_validate({"speculation": None, "router": "default",
                                                         "autoscaling": {"policy": "ongoing"}}))
    assert "request_router_config" not in plain and "policy" not in plain["autoscaling_config"]
    with pytest.raises(ValueError, match="min_replicas"):
        AppConfig.model_validate({"speculation": None, "autoscaling": {"min_replicas": 3, "max_replicas": 2}})


# ---- failover ------------------------------------------------------------------------------------------------
class ReplicaStream:
    """A streaming handle call's stand-in: events, then (optionally) the replica's death."""

    def __init__(self, events: list, dies: bool = False, hangs: bool = False) -> None:
        self.events, self.dies, self.hangs, self.cancelled = list(events), dies, hangs, False

    async def __anext__(self):
        if self.events:
            return self.events.pop(0)
        if self.dies:
            raise ActorDiedError()
        if self.hangs:  # no replica takes the call (Serve queues it until one is up)
            await asyncio.Event().wait()
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.cancelled = True


ACCEPTED = Accepted(prompt_tokens=3)


def delta(text: str, finished: bool = False) -> Delta:
    return Delta(text, [1], 1, finished=finished)


def drain(stream: FailoverStream) -> list:
    async def run():
        return [event async for event in stream]

    return asyncio.run(run())


def replicas(*streams: ReplicaStream):
    calls = []

    def start(call: GenerateCall) -> ReplicaStream:
        calls.append(call)
        return streams[len(calls) - 1]

    return start, calls


def test_a_death_before_the_first_token_is_retried_elsewhere_once_and_accepted_once():
    start, calls = replicas(ReplicaStream([ACCEPTED], dies=True), ReplicaStream([ACCEPTED, delta("ok", True)]))
    events = drain(FailoverStream(start, completion("p", temperature=1.0), streaming=True))
    assert events == [ACCEPTED, delta("ok", True)]
    assert calls[1].retry_of == calls[0].request_id != calls[1].request_id
    assert calls[1].params == calls[0].params  # same seed, same everything


def test_a_stream_that_sent_tokens_ends_with_the_error():
    start, calls = replicas(ReplicaStream([ACCEPTED, delta("a")], dies=True), ReplicaStream([ACCEPTED]))
    stream = FailoverStream(start, completion("p", temperature=0), streaming=True)
    with pytest.raises(ActorDiedError):
        drain(stream)
    assert len(calls) == 1


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.8, seed=3), dict(temperature=0.8)],
                         ids=["greedy", "seeded", "unseeded"])
def test_a_unary_request_is_retried_whole_and_its_first_tokens_are_void(sampling):
    """Its client has seen nothing: greedy, seeded or unseeded, a fresh answer is as good as the lost one."""
    start, calls = replicas(ReplicaStream([ACCEPTED, delta("a")], dies=True),
                            ReplicaStream([ACCEPTED, delta("c"), delta("b", True)]))
    events = drain(FailoverStream(start, completion("p", **sampling), streaming=False))
    assert events == [ACCEPTED, delta("a"), Restart(), delta("c"), delta("b", True)]
    assert len(calls) == 2


def test_a_second_death_is_not_retried():
    start, calls = replicas(ReplicaStream([], dies=True), ReplicaStream([], dies=True), ReplicaStream([ACCEPTED]))
    with pytest.raises(ActorDiedError):
        drain(FailoverStream(start, completion("p", temperature=0.8, seed=3), streaming=False))
    assert len(calls) == 2


def test_a_retry_no_replica_takes_fails_after_the_bound_and_is_cancelled():
    """The only replica died mid-answer and is restarting: the retry waits for it at most wait_s, then fails with
    NoReplicaInTime (the front's 503 with Retry-After), and Serve's queued call is cancelled."""
    queued = ReplicaStream([], hangs=True)
    start, calls = replicas(ReplicaStream([ACCEPTED, delta("a")], dies=True), queued)
    stream = FailoverStream(start, completion("p", temperature=0), streaming=False, wait_s=0.01)
    with pytest.raises(NoReplicaInTime, match="within 0.01 s") as failure:
        drain(stream)
    assert len(calls) == 2 and queued.cancelled and failure.value.retry_after_s == 1
    # a slow answer after the first event is not bounded: a long generation is not a missing replica
    slow = ReplicaStream([ACCEPTED, delta("a")])
    start, _ = replicas(slow)
    stream = FailoverStream(start, completion("p", temperature=0), streaming=True, wait_s=0.01)

    async def first_two_then_hang():
        events = [await anext(stream), await anext(stream)]
        slow.hangs = True
        with pytest.raises(TimeoutError):  # still waiting when the test gives up: no NoReplicaInTime
            await asyncio.wait_for(anext(stream), 0.1)
        return events

    assert asyncio.run(first_two_then_hang()) == [ACCEPTED, delta("a")]


def test_a_refused_retry_fails_the_generation_and_request_errors_are_never_retried():
    start, _ = replicas(ReplicaStream([ACCEPTED], dies=True), ReplicaStream([Refused(429, "overloaded")]))
    with pytest.raises(GenerationFailed, match="overloaded"):
        drain(FailoverStream(start, completion("p", temperature=0), streaming=True))
    assert not may_retry(ValueError("bad"), 1, False, True)
    assert may_retry(ActorDiedError(), 1, False, True) and not may_retry(ActorDiedError(), 2, False, True)
    assert may_retry(ActorDiedError(), 1, True, False)  # not streamed: its caller has seen nothing
    assert not may_retry(ActorDiedError(), 1, True, True)  # a stream that sent tokens
