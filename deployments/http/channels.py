"""Channels, the ingress's side: one channel to each replica its streamed generations run on (wire.ChannelCall,
replica/channels.py), read by one task that hands each batch's deltas to their generations' streams.

`ChanneledStream` is one attempt at one generation, read as FailoverStream reads a replica's stream: the
acceptance or refusal from the generation's own stream, then its deltas in order. They come by the channel while
the replica has one open and on the own stream otherwise (before the channel is open, after one ended), and two
streams keep no order between them, so deltas are put back in order by their token offsets. The generation ends
with its finished delta. Its own stream ending first means that delta is on its way by the channel; if no channel
to that replica is left to bring it, the generation fails with `ChannelLost` (its replica died: failover decides).
Deltas that came while the caller was not reading are handed on as one (`Delta.then`)."""
from __future__ import annotations

import asyncio
import heapq
import logging
from collections import deque
from dataclasses import replace

from deployments.placement.failover import is_replica_failure
from deployments.wire import Accepted, ChannelCall, ChannelOpen, Delta, Event, GenerateCall

logger = logging.getLogger("ray.serve")
OPEN_TIMEOUT_S = 10.0  # a channel the router has not placed by then (its replica gone) is given up
_END = object()


class ChannelLost(RuntimeError):
    """The channel that was to bring a generation's last delta ended without it."""


class Channels:
    """This ingress replica's channels (caller: its actor id), one reader task per replica, and the streams they
    feed, by request id."""

    def __init__(self, server, caller: str) -> None:
        self.server, self.caller = server, caller
        self.readers: dict[str, asyncio.Task] = {}  # replica id -> the task reading its channel
        self.opened: set[asyncio.Task] = set()  # readers whose replica took the channel
        self.streams: dict[str, ChanneledStream] = {}

    def start(self, call: GenerateCall) -> ChanneledStream:
        """One attempt at a streamed generation, its deltas by channel where the replica can."""
        return ChanneledStream(self, replace(call, channel=True, caller=self.caller))

    def ensure(self, replica_id: str, reopen: bool) -> None:
        """A channel to the replica: opened where none is, or where the replica has none open (reopen) though
        this side still reads one that took (it ended there and the end is on its way)."""
        reader = self.readers.get(replica_id)
        if reader is None or (reopen and reader in self.opened):
            self.readers[replica_id] = asyncio.get_running_loop().create_task(self._read(replica_id))

    def live(self, replica_id: str) -> bool:
        return replica_id in self.readers

    async def _read(self, replica_id: str) -> None:
        me = asyncio.current_task()
        stream = self.server.options(stream=True).channel.remote(ChannelCall(self.caller, replica_id))
        ended: BaseException | None = None
        try:
            first = await asyncio.wait_for(anext(stream), OPEN_TIMEOUT_S)
            if not isinstance(first, ChannelOpen):
                raise ChannelLost(f"replica {replica_id} answered a channel with {type(first).__name__}")
            self.opened.add(me)
            async for batch in stream:
                for request_id, delta in batch.deltas:
                    if (generation := self.streams.get(request_id)) is not None:
                        generation.offer(delta)
        except asyncio.CancelledError:
            stream.cancel()
            raise
        except Exception as exc:  # its replica died, or never took it: deltas stay on the own streams
            stream.cancel()
            ended = exc
            logger.info("channel to replica %s ended: %r", replica_id, exc)
        finally:
            self.opened.discard(me)
            if self.readers.get(replica_id) is me:
                del self.readers[replica_id]
                for generation in list(self.streams.values()):
                    generation.channel_gone(replica_id, ended)


class ChanneledStream:
    """One generation attempt's events (see the module's docstring); cancel() stops it on its replica."""

    def __init__(self, channels: Channels, call: GenerateCall) -> None:
        self.channels, self.request_id = channels, call.request_id
        self.own = channels.server.options(stream=True).generate.remote(call)
        self.events: deque = deque()  # what the caller has yet to read, in order
        self.wake = asyncio.Event()
        self.held: list[tuple[int, bool, int, Delta]] = []  # (token offset, finished, arrival, delta), a heap
        self.arrivals = 0
        self.next_offset = 0  # tokens handed on so far
        self.replica_id = ""  # where the replica sends deltas by channel: the one that took it
        self.accepted = self.own_ended = self.finished = self.over = False
        channels.streams[self.request_id] = self
        self.pump = asyncio.get_running_loop().create_task(self._pump())

    def __aiter__(self) -> ChanneledStream:
        return self

    async def __anext__(self) -> Event:
        if self.over:
            raise StopAsyncIteration
        while not self.events:
            self.wake.clear()
            await self.wake.wait()
        item = self.events.popleft()
        if item is _END or isinstance(item, BaseException):
            self._done()
            if item is _END:
                raise StopAsyncIteration
            raise item
        # deltas the caller has not read yet go on as one: a caller that falls behind (a loaded ingress) sends
        # fewer, longer chunks, one message each to Serve's proxy, instead of falling further behind
        while isinstance(item, Delta) and self.events and isinstance(self.events[0], Delta):
            item = item.then(self.events.popleft())
        return item

    def _put(self, item) -> None:
        self.events.append(item)
        self.wake.set()

    async def _pump(self) -> None:
        try:
            async for event in self.own:
                if isinstance(event, Delta):
                    self.offer(event)
                    continue
                self._put(event)
                if isinstance(event, Accepted):
                    self.accepted = True
                    if event.replica_id:
                        self.replica_id = event.replica_id
                        self.channels.ensure(event.replica_id, event.open_channel)
                    self._release()
            self.own_ended = True
            if not self.finished and not (self.replica_id and self.channels.live(self.replica_id)):
                self._put(_END if not self.replica_id else
                          ChannelLost(f"replica {self.replica_id} ended the generation's stream before its last "
                                      "delta, and no channel to it is left"))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # its replica failed: FailoverStream decides
            self._put(exc)

    def offer(self, delta: Delta) -> None:
        """A delta from either stream: handed on once the acceptance and every token before it have been (the
        channel may bring the first deltas before the own stream brings the acceptance)."""
        if self.finished:
            return
        start = delta.completion_tokens - len(delta.token_ids)
        if self.accepted and not self.held and start <= self.next_offset:  # in order: the common case
            self._hand_on(delta)
            return
        self.arrivals += 1
        heapq.heappush(self.held, (start, delta.finished, self.arrivals, delta))
        if self.accepted:
            self._release()

    def _release(self) -> None:
        while self.held and self.held[0][0] <= self.next_offset and not self.finished:
            self._hand_on(heapq.heappop(self.held)[3])

    def _hand_on(self, delta: Delta) -> None:
        self.next_offset = max(self.next_offset, delta.completion_tokens)
        self._put(delta)
        if delta.finished:
            self.finished = True
            self._put(_END)

    def channel_gone(self, replica_id: str, error: BaseException | None) -> None:
        """No channel to replica_id is left: a generation whose own stream has ended waits for nothing more. It
        fails with the channel's error where that is its replica's failure (failover's rules apply), else with
        ChannelLost."""
        if replica_id == self.replica_id and self.own_ended and not self.finished:
            self._put(error if is_replica_failure(error) else
                      ChannelLost(f"the channel to replica {replica_id} ended before the generation's last delta"))

    def cancel(self) -> None:
        try:
            self.own.cancel()
        except Exception:  # a call refused at submission re-raises its refusal here: it has nothing to stop
            pass
        self.pump.cancel()
        self._done()

    def _done(self) -> None:
        self.over = True
        if self.channels.streams.get(self.request_id) is self:
            del self.channels.streams[self.request_id]
