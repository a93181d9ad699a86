import asyncio

import pytest

from smartspec import LLM, EngineConfig, SamplingParams
from smartspec.engine.async_engine import AsyncEngine


@pytest.fixture(scope="module")
def llm(tiny_qwen):
    return LLM(tiny_qwen, num_kv_blocks=64, block_size=4, max_model_len=128)


def test_seeded_sampling_is_deterministic_and_seeds_matter(llm):
    p = [SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, top_k=50, seed=s, ignore_eos=True)
         for s in (1, 1, 2)]
    a, b, c = llm.generate(["hello"] * 3, p)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_top_k_one_is_greedy(llm):
    greedy = llm.generate("hello", SamplingParams(max_tokens=15, ignore_eos=True))[0]
    k1 = llm.generate("hello", SamplingParams(max_tokens=15, temperature=0.7, top_k=1, seed=3, ignore_eos=True))[0]
    assert greedy.token_ids == k1.token_ids


@pytest.mark.parametrize("kwargs,message", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"), ({"max_tokens": 0}, "max_tokens"), ({"seed": -1}, "seed"),
    ({"stop": [""]}, "stop"), ({"temperature": float("nan")}, "temperature"),
])
def test_invalid_sampling_params_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_bad_prompts_are_rejected(llm):
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate("")
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate("a" * 500)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[10, 10**9]])


def test_bad_engine_configuration_is_rejected(tiny_qwen):
    with pytest.raises(ValueError, match="unknown model"):
        LLM("no-such-model")
    with pytest.raises(ValueError, match="cannot hold one request"):
        LLM(tiny_qwen, num_kv_blocks=2, block_size=4, max_model_len=128)
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="float8")
    with pytest.raises(ValueError, match="device"):
        EngineConfig(device="tpu")


def test_dtype_auto_is_fp32_on_the_cpu_and_bf16_on_a_gpu():
    assert EngineConfig().dtype == "float32"  # the CPU kernels compute in fp32
    assert EngineConfig(device="cuda").dtype == "bfloat16"
    assert EngineConfig(device="cuda:1", dtype="float16").dtype == "float16"


def test_stops_max_tokens_and_stop_strings(llm):
    base = llm.generate("abc", SamplingParams(max_tokens=30, ignore_eos=True))[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 30
    stop_tok = base.token_ids[4]
    first = base.token_ids.index(stop_tok)
    by_id = llm.generate("abc", SamplingParams(max_tokens=30, stop_token_ids=[stop_tok], ignore_eos=True))[0]
    assert by_id.finish_reason == "stop" and by_id.token_ids == base.token_ids[: first + 1]
    needle = base.text[5:8]
    by_text = llm.generate("abc", SamplingParams(max_tokens=30, stop=[needle], ignore_eos=True))[0]
    assert by_text.finish_reason == "stop" and by_text.text == base.text[: base.text.index(needle)]


def test_async_engine_streams_and_abort_frees_blocks(llm):
    engine = AsyncEngine(engine=llm.engine)

    async def main():
        streamed = []
        async for out in engine.generate("hello", SamplingParams(max_tokens=12, ignore_eos=True), "s1"):
            streamed.extend(out.new_token_ids)
        gen = engine.generate("hello", SamplingParams(max_tokens=100, ignore_eos=True), "s2")
        async for _ in gen:
            break  # the client goes away after the first token
        await gen.aclose()
        for _ in range(50):
            await asyncio.sleep(0.02)
            if not llm.engine.has_unfinished():
                break
        return streamed

    streamed = asyncio.run(main())
    assert streamed == llm.generate("hello", SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
    assert not llm.engine.has_unfinished()
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks


def test_async_engine_call_submit_discard_and_a_failed_step(tiny_qwen):
    engine = AsyncEngine(EngineConfig(model=tiny_qwen, num_kv_blocks=64, max_model_len=256))

    async def main():
        assert await engine.call(lambda e: e.blocks.num_free) == 64
        with pytest.raises(ValueError, match="the context holds 256"):
            engine.submit("x" * 300, None, "too-long")  # refused at once, before any waiting
        n, _ = engine.submit("hello", SamplingParams(max_tokens=50, ignore_eos=True), "never-read")
        assert n == 5 and engine.num_in_flight == 1
        engine.discard("never-read")  # a stream that is never iterated still gives its request back
        assert await engine.call(lambda e: e.has_unfinished()) is False

        def broken_step():
            raise RuntimeError("boom")
        engine.engine.step = broken_step
        with pytest.raises(RuntimeError, match="boom"):
            async for _ in engine.generate("hello", SamplingParams(max_tokens=5), "r"):
                pass
        with pytest.raises(RuntimeError, match="engine stopped"):
            await engine.call(lambda e: None)  # no waiting forever on a dead step loop
        with pytest.raises(RuntimeError, match="engine stopped"):
            engine.submit("hello", None, "late")

    asyncio.run(main())
    assert engine.engine.blocks.num_free == 64


def test_streamed_text_never_contains_a_stop_string(llm):
    base = llm.generate("abc", SamplingParams(max_tokens=30, ignore_eos=True))[0]
    needle = base.text[10:13]
    eng = llm.engine
    rid = eng.add_request("abc", SamplingParams(max_tokens=30, stop=[needle], ignore_eos=True))
    streamed = ""
    while eng.has_unfinished():
        for out in eng.step():
            assert out.request_id == rid
            streamed += out.new_text
            assert needle not in streamed
            assert streamed == out.text[: len(streamed)]
    assert streamed == base.text[: base.text.index(needle)]
