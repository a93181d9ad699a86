"""The model-less engine behind scripts/bench_serving_path.py, under the AsyncEngine a replica runs: every request
gets its max_tokens of the cycle's text, at most max_num_seqs at a time, and an abort ends a stream."""
import asyncio

import pytest

from smartspec.bench.paced_engine import CYCLE_TEXT, PacedEngine
from smartspec.engine.async_engine import AsyncEngine
from smartspec.types.sampling_params import SamplingParams


async def _collect(engine: AsyncEngine, request_id: str, max_tokens: int):
    _, stream = engine.submit("a prompt", SamplingParams(max_tokens=max_tokens), request_id)
    outs = [out async for out in stream]
    return "".join(o.new_text for o in outs), outs[-1]


def test_each_request_gets_its_tokens_and_waits_for_a_row():
    paced = PacedEngine(0.001, max_num_seqs=2)
    engine = AsyncEngine(engine=paced)

    async def main():
        return await asyncio.gather(*[_collect(engine, f"r{i}", 7 + i) for i in range(5)])

    results = asyncio.run(main())
    for i, (text, last) in enumerate(results):
        assert text == (CYCLE_TEXT * 2)[:7 + i]  # byte tokens: one character each
        assert last.finish_reason == "length" and len(last.token_ids) == 7 + i
    # two rows: five requests of 7..11 tokens take more steps than the longest alone, fewer than all in turn
    steps = paced.totals.steps
    assert 11 < steps < 7 + 8 + 9 + 10 + 11
    assert paced.totals.generated_tokens == sum(range(7, 12))


def test_abort_ends_the_stream_and_frees_the_row():
    paced = PacedEngine(0.001, max_num_seqs=1)
    engine = AsyncEngine(engine=paced)

    async def main():
        _, stream = engine.submit("x", SamplingParams(max_tokens=1000), "long")
        first = await stream.__anext__()
        await stream.aclose()  # the caller gone: the request aborted, its row free for the next
        text, last = await _collect(engine, "next", 3)
        return first, text, last

    first, text, last = asyncio.run(main())
    assert first.new_text == CYCLE_TEXT[0]
    assert text == CYCLE_TEXT[:3] and last.finish_reason == "length"
    assert not paced.has_unfinished()


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="step_s"):
        PacedEngine(0.0)
    paced = PacedEngine(0.01, max_model_len=8)
    with pytest.raises(ValueError, match="max_model_len"):
        paced.check_request("a prompt longer than eight", SamplingParams())


def test_an_output_keeps_the_tokens_of_its_own_step():
    """As LLMEngine's: an output read after later steps (a replica behind its engine) counts its own tokens."""
    paced = PacedEngine(0.001)
    paced.add_request([1, 2], SamplingParams(max_tokens=5), "r")
    first, second = paced.step()[0], paced.step()[0]
    assert len(first.token_ids) == 1 and len(second.token_ids) == 2
