"""Tensor parallelism: the target sharded over 2 Ray worker actors (gloo) gives the greedy output of 1 process."""
import pytest
import torch

pytest.importorskip("ray")

from lossless import assert_greedy_equal  # noqa: E402

from smartspec import EngineConfig, SamplingParams  # noqa: E402
from smartspec.engine.llm_engine import LLMEngine  # noqa: E402

PROMPTS = ["hello world", "def f(x):\n    return", "abcabcabc", "The quick brown fox jumps"]


def _greedy(engine: LLMEngine, n: int = 24) -> list[list[int]]:
    ids = [engine.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p in PROMPTS]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return [done[i] for i in ids]


def test_tp2_equals_tp1(ray_serve, tiny_qwen):
    from transformers import AutoModelForCausalLM

    from deployments.tp_workers import TPModelRunner

    config = EngineConfig(model=tiny_qwen, num_kv_blocks=64, max_model_len=256, use_kernels=False)
    single = LLMEngine(config)
    sharded = LLMEngine(config, runner_factory=lambda loaded, blocks: TPModelRunner(
        loaded, blocks, 2, "float32", "cpu", num_cpus=0.1, num_threads=1))
    try:
        assert sharded.model is None  # the replica holds no weights: the ranks do
        assert [len(w) for w in [sharded.runner.workers]] == [2]
        ref_model = AutoModelForCausalLM.from_pretrained(tiny_qwen, dtype=torch.float32).eval()
        for prompt, ours, ref in zip(PROMPTS, _greedy(sharded), _greedy(single)):
            assert_greedy_equal(ours, ref, single.tokenize(prompt), ref_model)
        assert sharded.blocks.num_free == sharded.blocks.num_blocks
        _check_served_tp_app(ray_serve, tiny_qwen, sharded)
    finally:
        sharded.close()


def _check_served_tp_app(url, tiny_qwen, sharded):
    """`tensor_parallel_size: 2` in the application config: its workers join the replica's placement group and
    the served text is the sharded engine's."""
    import httpx
    from ray import serve

    from deployments.app import build_app

    args = {"model": tiny_qwen, "served_model_name": "tiny", "speculation": {"method": "none"},
            "tensor_parallel_size": 2, "tp_num_cpus": 0.1, "replica_num_cpus": 0.1, "num_threads": 1,
            "use_kernels": False, "kv_cache_gib": 0.01, "max_model_len": 256, "warmup_profile": False}
    serve.run(build_app(args), name="tp", route_prefix="/tp")
    try:
        r = httpx.post(f"{url}/tp/v1/completions", json={"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 24,
                                                         "temperature": 0, "ignore_eos": True}, timeout=120)
        assert r.status_code == 200, r.text
        rid = sharded.add_request(PROMPTS[0], SamplingParams(max_tokens=24, ignore_eos=True))
        text = None
        while sharded.has_unfinished():
            for out in sharded.step():
                if out.request_id == rid and out.finished:
                    text = out.text
        assert r.json()["choices"][0]["text"] == text
    finally:
        serve.delete("tp")


def test_tp_refuses_heads_it_cannot_split(ray_serve, tiny_qwen):
    from deployments.tp_workers import TPModelRunner

    config = EngineConfig(model=tiny_qwen, num_kv_blocks=64, max_model_len=256, use_kernels=False)
    with pytest.raises(ValueError, match="cannot be split over tensor_parallel_size=3"):
        LLMEngine(config, runner_factory=lambda loaded, blocks: TPModelRunner(
            loaded, blocks, 3, "float32", "cpu", num_cpus=0.1, num_threads=1))
