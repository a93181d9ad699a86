"""A generation's deltas as the replica's messages (deployments/replica/deltas.py `held`): each as it comes, or
the first at once, then gathered, the held ones sent when the interval has passed even while no more come, and the
source closed when the caller leaves. No Ray: an async source of deltas stands for the engine's stream."""
import asyncio

from deployments.replica.deltas import held
from deployments.wire import Delta


def _delta(i: int, n: int) -> Delta:
    return Delta(chr(97 + i), [i], i + 1, first=i == 0, finished=i == n - 1, finish_reason="length" if i == n - 1
                 else None)


async def _source(n: int, gate: asyncio.Event | None = None, after: int = 0, log: list | None = None):
    try:
        for i in range(n):
            if gate is not None and i == after:
                await gate.wait()
            yield _delta(i, n)
    finally:
        if log is not None:
            log.append("closed")


def _messages(gen) -> list[Delta]:
    async def main():
        return [m async for m in gen]

    return asyncio.run(main())


def test_without_an_interval_each_delta_is_a_message():
    out = _messages(held(_source(5), 0.0))
    assert [m.text for m in out] == list("abcde")


def test_within_the_interval_the_first_goes_at_once_and_the_rest_together():
    out = _messages(held(_source(6), 60.0))
    assert [m.text for m in out] == ["a", "bcdef"]
    assert out[0].first and out[1].finished and out[1].token_ids == [1, 2, 3, 4, 5] and out[1].completion_tokens == 6


def test_held_tokens_are_sent_when_the_interval_passes_though_no_more_come():
    async def main():
        gate = asyncio.Event()
        gen = held(_source(4, gate, after=2), 0.01)
        seen = [await anext(gen), await anext(gen)]  # the second arrives while the source waits at its gate
        gate.set()
        seen += [m async for m in gen]
        return seen

    assert [m.text for m in asyncio.run(main())] == ["a", "b", "cd"]


def test_a_caller_that_leaves_while_a_delta_is_awaited_closes_the_source():
    async def main():
        gate, log = asyncio.Event(), []
        gen = held(_source(4, gate, after=2, log=log), 0.01)
        first, second = await anext(gen), await anext(gen)
        await gen.aclose()  # the caller gone with the source waiting at its gate
        return first, second, log

    first, second, log = asyncio.run(main())
    assert (first.text, second.text, log) == ("a", "b", ["closed"])


def test_untimed_held_tokens_wait_for_the_next_delta():
    """An answer sent whole: no waiting on a timer (nor a task per delta); held tokens go with the next delta."""
    async def main():
        gate = asyncio.Event()
        gen = held(_source(3, gate, after=2), 0.001, timed=False)
        first = await anext(gen)
        later = asyncio.ensure_future(anext(gen))
        await asyncio.sleep(0.05)  # far past the interval: a timed hold would have sent "b" by now
        waiting = not later.done()
        gate.set()
        return first, waiting, await later

    first, waiting, rest = asyncio.run(main())
    assert first.text == "a" and waiting and rest.text == "bc" and rest.finished
