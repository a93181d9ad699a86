"""The asyncio streaming engine: submit, stream tokens, abort. The Ray Serve replica drives this."""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from smartspec.config import EngineConfig
from smartspec.engine.llm_engine import LLMEngine, RequestOutput
from smartspec.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class AsyncEngine:
    """Steps run on one worker thread so the event loop stays free; adds and aborts are queued and applied
    between steps, on that thread, so the engine's state is only ever touched by one thread."""

    def __init__(self, config: EngineConfig | None = None, engine: LLMEngine | None = None) -> None:
        self.engine = engine or LLMEngine(config or EngineConfig())
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="smartspec-step")
        self._queues: dict[str, asyncio.Queue] = {}
        self._pending: list[tuple[str, object]] = []  # ("add", args) / ("abort", request_id)
        self._lock = threading.Lock()
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self.errored: BaseException | None = None

    async def generate(self, prompt: str | list[int], params: SamplingParams | None,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; the last has finished=True. Leaving early (a client gone) aborts it."""
        if self.errored is not None:
            raise RuntimeError(f"engine stopped after an error: {self.errored!r}")
        params = params or SamplingParams()
        # Validate now, in the caller's task, so bad input raises here rather than inside the step loop.
        ids = self.engine.tokenize(prompt)
        if len(ids) >= self.engine.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; the context holds {self.engine.max_model_len}")
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        with self._lock:
            self._pending.append(("add", (ids, params, request_id)))
        self._ensure_loop()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                with self._lock:
                    self._pending.append(("abort", request_id))
                self._ensure_loop()

    async def abort(self, request_id: str) -> None:
        with self._lock:
            self._pending.append(("abort", request_id))
        self._ensure_loop()

    def _ensure_loop(self) -> None:
        if self._wakeup is None:
            self._wakeup = asyncio.Event()
        self._wakeup.set()
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    def _apply_pending_and_step(self) -> list[RequestOutput]:
        with self._lock:
            pending, self._pending = self._pending, []
        outputs = []
        for kind, arg in pending:
            if kind == "add":
                ids, params, rid = arg
                try:
                    self.engine.add_request(ids, params, rid)
                except Exception as exc:  # reported to that request alone
                    outputs.append((rid, exc))
            else:
                out = self.engine.abort_request(arg)
                if out is not None:
                    outputs.append((arg, out))
        if self.engine.has_unfinished():
            outputs.extend((o.request_id, o) for o in self.engine.step())
        return outputs

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._wakeup.clear()
            try:
                results = await loop.run_in_executor(self._executor, self._apply_pending_and_step)
            except Exception as exc:  # a failed step fails every request in flight, explicitly
                logger.exception("engine step failed")
                self.errored = exc
                for q in self._queues.values():
                    q.put_nowait(exc)
                return
            for rid, item in results:
                if (q := self._queues.get(rid)) is not None:
                    q.put_nowait(item)
            with self._lock:
                idle = not self._pending and not self.engine.has_unfinished()
            if idle:
                await self._wakeup.wait()
