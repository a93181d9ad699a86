"""Channels, the replica's side: the deltas of all one caller's streams on this replica as one message a step.

A message costs Serve's proxy, the ingress and the replica about the same CPU whatever it carries
(docs/benchmarks.md, "The serving path"), so a replica that streams to 64 clients sends one message a step to
each ingress replica, not 64. A streamed generation whose caller asked for a channel (`GenerateCall.channel`)
joins the hub as a `Member` of its caller's group. While that caller's channel is attached (`LLMServer.channel`,
opened by a `ChannelCall`), the member's deltas go into the channel's next batch, sent once the step's outputs are
all in (the loop's next turn: the engine hands a step's outputs over in one callback), or, with hold_s, at most
every hold_s (a first or last delta at once). While none is attached they go on the generation's own stream
(`Member.route` returns them), as they did before channels. A channel that ends with deltas not yet sent gives
them back to their members, which send them on their own streams. A member's own stream ends only once its last
delta has gone: the caller hears of a replica that dies before then through that stream."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from deployments.wire import ChannelOpen, Delta, DeltaBatch

CHANNEL_IDLE_S = 2.0  # a channel without members ends after this long: a draining replica's calls all end


class Channel:
    """One caller's channel: the batch being gathered and the batches waiting for the stream to send them."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self.gathering: dict[str, Delta] = {}  # request id -> its deltas since the last batch, as one
        self.ready: asyncio.Queue[list[tuple[str, Delta]] | None] = asyncio.Queue()  # None: replaced, end
        self.flush_at: asyncio.Handle | None = None
        self.flushed = time.monotonic()

    def add(self, request_id: str, delta: Delta) -> None:
        held = self.gathering.get(request_id)
        self.gathering[request_id] = delta if held is None else held.then(delta)
        loop = asyncio.get_running_loop()
        wait_s = 0.0 if delta.first or delta.finished else max(0.0, self.flushed + self.hold_s - time.monotonic())
        # a flush already due this turn stays; a timer gives way to a flush now where this delta may not wait
        if self.flush_at is None or (wait_s == 0.0 and isinstance(self.flush_at, asyncio.TimerHandle)):
            if self.flush_at is not None:
                self.flush_at.cancel()
            self.flush_at = loop.call_soon(self.flush) if wait_s == 0.0 else loop.call_later(wait_s, self.flush)

    def flush(self) -> None:
        self._no_flush_due()
        if self.gathering:
            self.ready.put_nowait(list(self.gathering.items()))
            self.gathering = {}
        self.flushed = time.monotonic()

    def unsent(self) -> list[tuple[str, Delta]]:
        """Every delta not yet sent, in order; the channel keeps none after."""
        self._no_flush_due()
        out = []
        while not self.ready.empty():
            out.extend(self.ready.get_nowait() or [])
        out.extend(self.gathering.items())
        self.gathering = {}
        return out

    def _no_flush_due(self) -> None:
        if self.flush_at is not None:
            self.flush_at.cancel()
            self.flush_at = None


class Member:
    """One streamed generation whose deltas may go by its caller's channel."""

    def __init__(self, hub: ChannelHub, caller: str, request_id: str) -> None:
        self.hub, self.caller, self.request_id = hub, caller, request_id
        self.given_back: list[Delta] = []  # deltas a channel ended before sending: the own stream sends them
        self.last_sent = asyncio.Event()  # its finished delta went by a channel, or was given back
        self.last_by_channel = False

    @property
    def channel_open(self) -> bool:
        return self.caller in self.hub.channels

    def route(self, delta: Delta) -> list[Delta]:
        """What the member's own stream sends now: nothing while a channel carries its deltas."""
        out, self.given_back = self.given_back, []
        channel = self.hub.channels.get(self.caller)
        if channel is None:
            out.append(delta)
        else:
            channel.add(self.request_id, delta)
            self.last_by_channel = delta.finished
        self.hub.direct += len(out)
        return out

    async def rest(self) -> list[Delta]:
        """Once the last delta was routed: wait until it has gone by the channel; what was given back to send."""
        if self.last_by_channel:
            await self.last_sent.wait()
        out, self.given_back = self.given_back, []
        self.hub.direct += len(out)
        return out

    def leave(self) -> None:
        """Its generation ended or its caller left: deltas of it still gathered are dropped."""
        self.hub.members.pop(self.request_id, None)
        if (channel := self.hub.channels.get(self.caller)) is not None:
            channel.gathering.pop(self.request_id, None)


class ChannelHub:
    """The replica's channels, one per caller, and the generations that may use them."""

    def __init__(self, hold_s: float = 0.0) -> None:
        self.hold_s = hold_s
        self.channels: dict[str, Channel] = {}  # caller -> its attached channel
        self.members: dict[str, Member] = {}  # request id -> member
        self.batches = self.deltas = self.direct = 0  # sent by channels; deltas in them; deltas sent on own streams

    def join(self, caller: str, request_id: str) -> Member:
        member = self.members[request_id] = Member(self, caller, request_id)
        return member

    async def attach(self, caller: str) -> AsyncIterator[ChannelOpen | DeltaBatch]:
        """The caller's channel as a stream: ChannelOpen, then a batch as each is ready; it ends after
        CHANNEL_IDLE_S without members, or when the caller opens another (which replaces it)."""
        if (older := self.channels.get(caller)) is not None:
            older.ready.put_nowait(None)
        channel = self.channels[caller] = Channel(self.hold_s)
        try:
            yield ChannelOpen()
            while True:
                try:
                    async with asyncio.timeout(CHANNEL_IDLE_S):
                        batch = await channel.ready.get()
                except TimeoutError:
                    if not any(m.caller == caller for m in self.members.values()) and not channel.gathering:
                        return
                    continue
                if batch is None:
                    return
                yield DeltaBatch(tuple(batch))
                self._sent(batch)
        finally:
            if self.channels.get(caller) is channel:
                del self.channels[caller]
            self._give_back(channel.unsent())

    def _sent(self, batch: list[tuple[str, Delta]]) -> None:
        self.batches += 1
        self.deltas += len(batch)
        for request_id, delta in batch:
            if delta.finished and (member := self.members.get(request_id)) is not None:
                member.last_sent.set()

    def _give_back(self, unsent: list[tuple[str, Delta]]) -> None:
        for request_id, delta in unsent:
            if (member := self.members.get(request_id)) is not None:
                member.given_back.append(delta)
                if delta.finished:
                    member.last_sent.set()

    def stats(self) -> dict:
        return {"open": len(self.channels), "members": len(self.members), "batches": self.batches,
                "deltas": self.deltas, "direct": self.direct}
