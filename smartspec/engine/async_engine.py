"""The asyncio streaming engine: submit, stream tokens, abort. The Ray Serve replica drives this."""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from smartspec.config import EngineConfig
from smartspec.engine.llm_engine import LLMEngine, RequestOutput
from smartspec.types.sampling_params import SamplingParams
from smartspec.types.snapshot import EngineSnapshot, LoadCosts

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AddRequest:
    """Queue a validated request (its prompt's token ids) on the engine."""
    ids: list[int]
    params: SamplingParams
    request_id: str

    def apply(self, engine: LLMEngine, outputs: list) -> None:
        try:
            engine.add_request(self.ids, self.params, self.request_id)
        except Exception as exc:  # reported to that request alone
            outputs.append((self.request_id, exc))


@dataclass(frozen=True)
class AbortRequest:
    """End a request (a caller gone), freeing its blocks; its last output goes to its stream."""
    request_id: str

    def apply(self, engine: LLMEngine, outputs: list) -> None:
        out = engine.abort_request(self.request_id)
        if out is not None:
            outputs.append((self.request_id, out))


@dataclass(frozen=True)
class EngineCall:
    """Run fn(engine) between two steps; its result (or error) resolves the caller's future on its loop."""
    fn: Callable[[LLMEngine], object]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop

    def apply(self, engine: LLMEngine, outputs: list) -> None:
        try:
            result, error = self.fn(engine), None
        except Exception as exc:
            result, error = None, exc
        self.loop.call_soon_threadsafe(_resolve, self.future, result, error)


Command = AddRequest | AbortRequest | EngineCall


class AsyncEngine:
    """Steps run on one worker thread so the event loop stays free; adds and aborts are queued and applied
    between steps, on that thread, so the engine's state is only ever touched by one thread."""

    def __init__(self, config: EngineConfig | None = None, engine: LLMEngine | None = None,
                 build: Callable[[], LLMEngine] | None = None) -> None:
        """The engine: given, made by build(), or LLMEngine(config). build and config run on the step thread."""
        # torch (and OpenMP in the kernels) keep thread counts per thread: give the step thread this one's
        threads = torch.get_num_threads()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="smartspec-step",
                                            initializer=torch.set_num_threads, initargs=(threads,))
        # libgomp keeps a team of worker threads per thread that opens parallel regions, and once a process holds
        # more of them than cores its workers sleep at barriers, so every kernel call waits on woken threads (a
        # decode step about a fifth slower). So the step thread loads the model as well, and stays the only one.
        self.engine = engine or self._executor.submit(build or (lambda: LLMEngine(config or EngineConfig()))).result()
        self._queues: dict[str, asyncio.Queue] = {}
        self._pending: list[Command] = []  # applied on the step thread, in order, before the next step
        self._lock = threading.Lock()
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self.errored: BaseException | None = None

    def warm_grammars(self) -> threading.Thread:
        """Prepare structured outputs (the grammar library's view of the tokenizer) on a thread of its own, off the
        step thread, so the first structured request does not stall the batch; the thread, to join if needed."""
        thread = threading.Thread(target=self.engine.grammar_compiler.warm, name="smartspec-grammar-warmup",
                                  daemon=True)
        thread.start()
        return thread

    async def generate(self, prompt: str | list[int], params: SamplingParams | None,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; the last has finished=True. Leaving early (a client gone) aborts it."""
        _, stream = self.submit(prompt, params, request_id)
        async for out in stream:
            yield out

    def submit(self, prompt: str | list[int], params: SamplingParams | None,
               request_id: str) -> tuple[int, AsyncIterator[RequestOutput]]:
        """Validate and queue a request now (bad input raises ValueError here, before any waiting); return its
        prompt length and its output stream. Must run on the event loop's thread; iterate the stream to the end
        or leave it early (which aborts the request)."""
        if self.errored is not None:
            raise RuntimeError(f"engine stopped after an error: {self.errored!r}")
        params = params or SamplingParams()
        ids, params = self.engine.check_request(prompt, params)
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        with self._lock:
            self._pending.append(AddRequest(ids, params, request_id))
        self._ensure_loop()
        return len(ids), self._stream(request_id, queue)

    def discard(self, request_id: str) -> None:
        """Abort a submitted request whose stream may never have been iterated (a no-op once it has ended)."""
        if self._queues.pop(request_id, None) is not None:
            with self._lock:
                self._pending.append(AbortRequest(request_id))
            self._ensure_loop()

    async def _stream(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
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
                    self._pending.append(AbortRequest(request_id))
                self._ensure_loop()

    async def call(self, fn):
        """Run fn(engine) on the step thread between two steps (reading or changing engine state safely)."""
        if self.errored is not None:
            raise RuntimeError(f"engine stopped after an error: {self.errored!r}")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:
            self._pending.append(EngineCall(fn, fut, loop))
        self._ensure_loop()
        return await fut

    # ---- what a serving replica reads: the tokenizer, the context, stats and the policy's shared state ----------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def kv_capacity_tokens(self) -> int:
        blocks = self.engine.blocks
        return blocks.num_blocks * blocks.block_size

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return self.engine.tokenize(prompt)

    async def snapshot(self) -> EngineSnapshot:
        """The engine's snapshot (LLMEngine.snapshot), read between two steps."""
        return await self.call(lambda e: e.snapshot())

    async def load_costs(self) -> LoadCosts:
        """What more load costs (LLMEngine.load_costs), read between two steps."""
        return await self.call(lambda e: e.load_costs())

    async def import_policy_state(self, state: dict) -> None:
        """Adopt the replicas' merged policy state (from the goodput controller), between two steps."""
        await self.call(lambda e: e.speculation.policy.shared.import_state(state))

    def close(self) -> None:
        self.engine.close()

    @property
    def num_in_flight(self) -> int:
        """Requests accepted and not yet finished (queued, waiting or running)."""
        return len(self._queues)

    async def abort(self, request_id: str) -> None:
        with self._lock:
            self._pending.append(AbortRequest(request_id))
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
        for command in pending:
            command.apply(self.engine, outputs)
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
                with self._lock:
                    pending, self._pending = self._pending, []
                for command in pending:  # calls waiting for a step that will not come
                    if isinstance(command, EngineCall):
                        _resolve(command.future, None, RuntimeError(f"engine stopped after an error: {exc!r}"))
                return
            for rid, item in results:
                if (q := self._queues.get(rid)) is not None:
                    q.put_nowait(item)
            with self._lock:
                idle = not self._pending and not self.engine.has_unfinished()
            if idle:  # a kept profile the first steps found stale is measured now, between requests
                await loop.run_in_executor(self._executor, self.engine.measure_profile_if_due)
                await self._wakeup.wait()


def _resolve(fut: asyncio.Future, result, error: BaseException | None) -> None:
    if fut.done():  # the caller gave up waiting
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)
