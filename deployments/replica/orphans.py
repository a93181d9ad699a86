"""Orphaned generations: a generation whose caller (the ingress replica that asked for it) has died is aborted on
the replica, so a request the proxy guard sends again to a new ingress runs once, not once more beside a
generation nobody reads. Ray does not stop an actor's streaming call when its caller dies.

One watch per replica: every `interval_s` it asks Ray's control store once per distinct caller of the generations
in flight (one or two ingress replicas, not one query per request) and aborts the generations of the dead."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

logger = logging.getLogger("ray.serve")


def actor_alive(actor_id: str) -> bool:
    """Whether Ray's control store holds the actor as anything but DEAD (True where it cannot say)."""
    from ray._private import state  # the GCS actor table: Ray's public state API needs the dashboard

    try:
        info = state.actors(actor_id=actor_id)
    except Exception:
        return True
    return not info or info.get("State") != "DEAD"


class OrphanWatch:
    """Generations in flight by their callers; abort(request_id) ends one (the replica's engine abort)."""

    def __init__(self, abort: Callable[[str], Awaitable[None]], interval_s: float = 1.0,
                 alive: Callable[[str], bool] = actor_alive) -> None:
        self.abort, self.interval_s, self.alive = abort, interval_s, alive
        self.callers: dict[str, str] = {}  # request id -> its caller's actor id
        self.aborted = 0
        self._task: asyncio.Task | None = None

    def add(self, request_id: str, caller: str | None) -> None:
        if caller is None:
            return
        self.callers[request_id] = caller
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._watch())

    def remove(self, request_id: str) -> None:
        self.callers.pop(request_id, None)

    async def _watch(self) -> None:
        while self.callers:
            await asyncio.sleep(self.interval_s)
            for caller in set(self.callers.values()):
                if await asyncio.to_thread(self.alive, caller):
                    continue
                orphans = [rid for rid, c in self.callers.items() if c == caller]
                logger.warning("caller %s is gone: aborting its %d generation(s)", caller, len(orphans))
                for rid in orphans:
                    self.callers.pop(rid, None)
                    self.aborted += 1
                    await self.abort(rid)
