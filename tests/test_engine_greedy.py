"""Greedy output of the engine equals transformers' generate, and does not depend on the batch around it."""
import pytest
import torch
from lossless import assert_greedy_equal, hf_greedy
from transformers import AutoModelForCausalLM

from smartspec import LLM, SamplingParams

PROMPTS = ["def add(a, b):", "Once upon a time", "x", "The quick brown fox jumps over the lazy dog. " * 3]


def _hf(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("fixture", ["tiny_qwen", "tiny_llama_tied"])
def test_engine_matches_transformers_generate(fixture, request):
    path = request.getfixturevalue(fixture)
    llm = LLM(path, num_kv_blocks=64, block_size=4, max_num_batched_tokens=32, max_model_len=256)
    hf = _hf(path)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=40))
    for out in outs:
        ref = hf_greedy(hf, out.prompt_token_ids, 40)
        assert_greedy_equal(out.token_ids, ref, out.prompt_token_ids, hf)
    assert llm.engine.blocks.num_free == 64


def test_batch_invariance_with_requests_joining_and_leaving(tiny_qwen):
    """A request's tokens are bitwise the same alone or amid others that join and leave mid-run."""
    llm = LLM(tiny_qwen, num_kv_blocks=64, block_size=4, max_num_batched_tokens=16, max_model_len=256)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (30, 5, 17, 9)]
    alone = [llm.generate(p, sp)[0].token_ids for p, sp in zip(PROMPTS, params)]
    eng = llm.engine
    ids = {eng.add_request(PROMPTS[0], params[0]): 0}
    got: dict[int, list[int]] = {i: [] for i in range(4)}
    step = 0
    while eng.has_unfinished():
        if step in (3, 6, 11):  # the others join at different points, prefill chunks mixed with decodes
            i = (3, 6, 11).index(step) + 1
            ids[eng.add_request(PROMPTS[i], params[i])] = i
        for out in eng.step():
            got[ids[out.request_id]].extend(out.new_token_ids)
        step += 1
    assert [got[i] for i in range(4)] == alone
    assert eng.blocks.num_free == 64


def test_preemption_under_a_small_cache_keeps_outputs(tiny_qwen):
    roomy = LLM(tiny_qwen, num_kv_blocks=128, block_size=4)
    tight = LLM(tiny_qwen, num_kv_blocks=40, block_size=4, max_model_len=128)  # 160 slots; 211 needed
    p = SamplingParams(max_tokens=60, ignore_eos=True)
    expect = [o.token_ids for o in roomy.generate(PROMPTS[:3], p)]
    assert [o.token_ids for o in tight.generate(PROMPTS[:3], p)] == expect
    assert tight.engine.scheduler.num_preemptions > 0  # the cache was too small for all three at once
    assert tight.engine.blocks.num_free == 40


@pytest.mark.real_model
def test_real_model_matches_transformers_generate(smollm):
    llm = LLM(smollm, kv_cache_gib=0.25, max_model_len=1024, quantization=None)  # the fp32 weights
    hf = _hf(smollm)
    chat = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Write a Python function is_prime(n)."}],
                                             tokenize=False, add_generation_prompt=True)
    prompts = [chat, "def fibonacci(n):", "The capital of France is"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=32))
    for out in outs:
        ref = hf_greedy(hf, out.prompt_token_ids, 32)
        assert_greedy_equal(out.token_ids, ref, out.prompt_token_ids, hf)
    alone = llm.generate(prompts[1], SamplingParams(max_tokens=32))[0]
    assert alone.token_ids == outs[1].token_ids


def test_torch_fallback_path_matches_transformers(tiny_qwen):
    """Without the compiled kernels (no compiler, or a GPU) the engine runs transformers' linears and a torch paged
    attention: still transformers' greedy output, up to proven near-ties."""
    llm = LLM(tiny_qwen, num_kv_blocks=64, block_size=4, max_model_len=256, use_kernels=False)
    assert not llm.engine.runner.use_kernels
    hf = _hf(tiny_qwen)
    for out in llm.generate(PROMPTS[:3], SamplingParams(max_tokens=30)):
        assert_greedy_equal(out.token_ids, hf_greedy(hf, out.prompt_token_ids, 30), out.prompt_token_ids, hf)
    assert llm.engine.blocks.num_free == 64
