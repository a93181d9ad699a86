"""Channels: the deltas of all one ingress's streams on a replica as one message a step (deployments/replica/
channels.py, deployments/http/channels.py). The replica is LLMServer over the paced engine and the ingress side is
its Channels and streams, in one event loop; what stands in is Ray's streaming call alone (`Transport`): each
call runs as its own task and its items reach the caller in order, with a delay that can differ from call to
call (two of Ray's streams keep no order between them)."""
from __future__ import annotations

import asyncio
import gc
import random
from functools import partial

import pytest
from ray.exceptions import ActorDiedError

from deployments.http.channels import Channels, ChannelLost
from deployments.placement.failover import FailoverStream
from deployments.replica.channels import ChannelHub
from deployments.replica.parts import start_paced_engine
from deployments.replica.server import LLMServer
from deployments.wire import Accepted, ChannelCall, Delta, GenerateCall
from smartspec.bench.paced_engine import CYCLE_TEXT
from smartspec.types.sampling_params import SamplingParams

CALLER = "ingress-actor-1"


class Transport:
    """One streaming call: the callee's generator runs as its own task, never waiting for its caller (as Ray's
    does); the caller reads its items in order, each up to `jitter_s` after it was yielded (and after the one
    before); cancel() stops the callee as Ray's cancel does."""

    def __init__(self, items, jitter_s: float, rng: random.Random) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.jitter_s, self.rng, self.due = jitter_s, rng, 0.0
        self.task = asyncio.get_running_loop().create_task(self._run(items))

    async def _run(self, items) -> None:
        try:
            async for item in items:
                self._put(item)
            self._put(StopAsyncIteration())
        except asyncio.CancelledError:  # the caller reads the cancellation, as Ray's TaskCancelledError
            self._put(ConnectionError("the call was cancelled"))
        except Exception as exc:
            self._put(exc)
        finally:
            await items.aclose()

    def _put(self, item) -> None:
        now = asyncio.get_running_loop().time()
        self.due = max(self.due, now + self.rng.random() * self.jitter_s)
        self.queue.put_nowait((self.due, item))

    def __aiter__(self):
        return self

    async def __anext__(self):
        due, item = await self.queue.get()
        await asyncio.sleep(max(0.0, due - asyncio.get_running_loop().time()))
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.task.cancel()


class Handle:
    """`server.options(stream=True).generate.remote(call)` and `.channel.remote(call)` over a replica in this loop;
    jitter_s: how late the generations' own items may come; `place` rewrites a channel's call (a router that sends
    it elsewhere)."""

    def __init__(self, replica, jitter_s: float = 0.0, seed: int = 0, place=None) -> None:
        self.replica, self.jitter_s, self.rng, self.place = replica, jitter_s, random.Random(seed), place
        self.channel_calls: list[Transport] = []

    def options(self, stream: bool):
        return self

    @property
    def generate(self):
        return _Remote(lambda call: Transport(self.replica.generate(call), self.jitter_s, self.rng))

    @property
    def channel(self):
        def open_channel(call: ChannelCall) -> Transport:
            # the channel's items come at once: the streams' own, up to jitter_s late, fall behind them
            transport = Transport(self.replica.channel(self.place(call) if self.place else call), 0.0, self.rng)
            self.channel_calls.append(transport)
            return transport
        return _Remote(open_channel)


class _Remote:
    def __init__(self, fn) -> None:
        self.remote = fn


def _replica(stream_interval_ms: float = 0.0):
    """LLMServer over the paced engine: a token to every running request each 5 ms."""
    server = LLMServer.func_or_class({"model": "paced", "speculation": None, "max_num_seqs": 16,
                                      "stream_interval_ms": stream_interval_ms},
                                     None, partial(start_paced_engine, 0.005))
    gc.unfreeze()  # the replica freezes its start's heap, for its process's life: not this test process's
    return server


@pytest.fixture
def replica():
    server = _replica()
    yield server
    server.engine.close()


def _call(max_tokens: int) -> GenerateCall:
    return GenerateCall(SamplingParams(max_tokens=max_tokens), prompt="go", caller=CALLER)


async def _read(stream) -> tuple[list, str]:
    events = [event async for event in stream]
    return events, "".join(e.text for e in events if isinstance(e, Delta))


def _check(events: list, text: str, max_tokens: int) -> None:
    assert isinstance(events[0], Accepted)
    deltas = [e for e in events[1:] if isinstance(e, Delta)]
    assert text == (CYCLE_TEXT * 20)[:max_tokens]
    assert [d.completion_tokens - len(d.token_ids) for d in deltas] == \
           [0] + [d.completion_tokens for d in deltas[:-1]]  # contiguous, in order
    assert deltas[-1].finished and deltas[-1].completion_tokens == max_tokens and deltas[0].first


def test_streams_come_back_by_one_channel_a_step(replica):
    """Eight streams through FailoverStream: each its exact text; the channel carried most deltas, several a
    message; nothing is left registered on either side."""
    async def main():
        channels = Channels(Handle(replica), CALLER)
        lengths = [30 + 3 * i for i in range(8)]
        streams = [FailoverStream(channels.start, _call(n), True) for n in lengths]
        results = await asyncio.gather(*[_read(s) for s in streams])
        return channels, lengths, results

    channels, lengths, results = asyncio.run(main())
    for (events, text), n in zip(results, lengths):
        _check(events, text, n)
    hub: ChannelHub = replica.channels
    assert hub.deltas + hub.direct == sum(lengths)  # a delta a step and stream, sent once
    assert hub.deltas >= 0.8 * sum(lengths) and hub.deltas >= 5 * hub.batches
    assert not hub.members and not channels.streams


def test_deltas_keep_their_order_when_the_streams_race(replica):
    """The streams' own items delayed by up to 30 ms each, the channel's not: a stream's deltas that came on its
    own stream before its channel opened, and later ones by the channel, reach it in order; streams started once
    the channel is open get their deltas by it before their acceptance arrives, and pass the acceptance on first."""
    async def main():
        channels = Channels(Handle(replica, jitter_s=0.03, seed=3), CALLER)
        lengths = [25 + 7 * i for i in range(6)]
        first = asyncio.ensure_future(_read(channels.start(_call(200))))
        streams = [channels.start(_call(n)) for n in lengths[:3]]
        while not replica.channels.channels:
            await asyncio.sleep(0.001)
        streams += [channels.start(_call(n)) for n in lengths[3:]]
        results = await asyncio.gather(*[_read(s) for s in streams])
        return [200] + lengths, [await first] + results

    lengths, results = asyncio.run(main())
    for (events, text), n in zip(results, lengths):
        _check(events, text, n)
    assert replica.channels.deltas > 0 and replica.channels.direct > 0  # both ways were taken


@pytest.mark.parametrize("stream_interval_ms", [0, 30])
def test_a_channel_that_ends_gives_its_deltas_back(stream_interval_ms):
    """The channel stopped mid-stream (its call cancelled): what it had not sent goes back to the streams, which
    send the rest on their own; every text is whole (with a hold, deltas are held when it stops)."""
    replica = _replica(stream_interval_ms)

    async def main():
        handle = Handle(replica)
        channels = Channels(handle, CALLER)
        lengths = [60, 70, 80]
        reading = [asyncio.ensure_future(_read(channels.start(_call(n)))) for n in lengths]
        while replica.channels.deltas < 20:
            await asyncio.sleep(0.005)
        handle.channel_calls[0].cancel()
        return lengths, await asyncio.gather(*reading)

    lengths, results = asyncio.run(main())
    replica.engine.close()
    for (events, text), n in zip(results, lengths):
        _check(events, text, n)
    assert replica.channels.direct > 0 and not replica.channels.channels


def test_a_caller_that_falls_behind_reads_the_deltas_since_as_one(replica):
    """Deltas that came while the caller was busy are handed on together: fewer, longer chunks, in order."""
    async def main():
        stream = Channels(Handle(replica), CALLER).start(_call(60))
        events = [await anext(stream), await anext(stream)]  # the acceptance, the first delta
        await asyncio.sleep(0.1)  # some 20 steps of 5 ms
        events += [event async for event in stream]
        return events

    events = asyncio.run(main())
    _check(events, "".join(e.text for e in events[1:]), 60)
    assert len(events[2].token_ids) >= 5 and len(events) < 60


def test_no_channel_where_the_router_places_it_elsewhere(replica):
    """A channel call that reaches another replica is not taken: the deltas come on the streams themselves."""
    async def main():
        elsewhere = Handle(replica, place=lambda call: ChannelCall(call.caller, "another-replica"))
        channels = Channels(elsewhere, CALLER)
        return await asyncio.gather(*[_read(channels.start(_call(20))) for _ in range(3)])

    for events, text in asyncio.run(main()):
        _check(events, text, 20)
    assert replica.channels.batches == 0 and replica.channels.direct == 60


def test_a_client_that_leaves_stops_its_generation_alone(replica):
    """One stream cancelled mid-way (its client gone): its request leaves the engine and the channel; the others
    finish whole."""
    async def main():
        channels = Channels(Handle(replica), CALLER)
        leaving = channels.start(_call(500))
        staying = [asyncio.ensure_future(_read(channels.start(_call(40)))) for _ in range(2)]
        assert isinstance(await anext(leaving), Accepted)
        await anext(leaving)
        leaving.cancel()
        results = await asyncio.gather(*staying)
        await asyncio.sleep(0.05)
        return results

    for events, text in asyncio.run(main()):
        _check(events, text, 40)
    assert not replica.channels.members and replica.engine.num_in_flight == 0


@pytest.mark.parametrize("channel_error, raised", [(ConnectionError("lost"), ChannelLost),
                                                    (ActorDiedError(), ActorDiedError)])
def test_a_stream_whose_channel_is_lost_fails_instead_of_waiting(channel_error, raised):
    """A replica ended a generation's own stream after its deltas went to a channel that then broke: the
    generation fails, it does not wait for ever; with the replica's death where that broke it (so that failover
    retries a generation whose caller has no token yet), else with ChannelLost."""
    class BrokenReplica:
        async def generate(self, call):
            yield Accepted(3, replica_id="r1", open_channel=True)

        async def channel(self, call):
            raise channel_error
            yield  # an async generator

    async def main():
        stream = Channels(Handle(BrokenReplica()), CALLER).start(_call(5))
        assert isinstance(await anext(stream), Accepted)
        with pytest.raises(raised):
            await asyncio.wait_for(anext(stream), 5)

    asyncio.run(main())


def test_a_hold_gathers_a_streams_deltas_and_sends_first_and_last_at_once():
    """With hold_s, deltas within it go as one; a first or finished delta goes on the loop's next turn."""
    async def main():
        hub = ChannelHub(hold_s=0.05)
        batches = []

        async def read():
            async for item in hub.attach(CALLER):
                batches.append(item)

        reader = asyncio.ensure_future(read())
        await asyncio.sleep(0)
        member = hub.join(CALLER, "a")
        assert member.route(Delta("x", [1], 1, first=True)) == []
        await asyncio.sleep(0.01)
        assert len(batches) == 2  # ChannelOpen, then the first delta at once
        for i in range(2, 5):
            member.route(Delta("y", [i], i))
        await asyncio.sleep(0.01)
        assert len(batches) == 2  # held
        await asyncio.sleep(0.06)
        assert len(batches) == 3 and batches[2].deltas[0][1].token_ids == [2, 3, 4]
        member.route(Delta("z", [5], 5, finished=True, finish_reason="stop"))
        assert await asyncio.wait_for(member.rest(), 1) == []
        member.leave()
        reader.cancel()

    asyncio.run(main())
