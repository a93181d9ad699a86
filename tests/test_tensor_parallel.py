"""Tensor parallelism: the target sharded over 2 Ray worker actors (gloo) gives the greedy output of 1 process,
on fp32 weights (transformers' sharding) and on GGUF weights kept quantized (each rank loads its part)."""
from types import SimpleNamespace

import pytest
import torch

ray = pytest.importorskip("ray")

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

    from deployments.replica.tp_workers import TPModelRunner, TPSettings

    config = EngineConfig(model=tiny_qwen, num_kv_blocks=64, max_model_len=256, use_kernels=False)
    single = LLMEngine(config)
    sharded = LLMEngine(config, runner_factory=lambda loaded, blocks: TPModelRunner(
        loaded, blocks, TPSettings(2, num_cpus=0.1, num_threads=1)))
    try:
        assert sharded.model is None  # the replica holds no weights: the ranks do
        assert [len(w) for w in [sharded.runner.workers]] == [2]
        ref_model = AutoModelForCausalLM.from_pretrained(tiny_qwen, dtype=torch.float32).eval()
        for prompt, ours, ref in zip(PROMPTS, _greedy(sharded), _greedy(single)):
            assert_greedy_equal(ours, ref, single.tokenize(prompt), ref_model)
        assert sharded.blocks.num_free == sharded.blocks.num_blocks
        _check_served_tp_app(ray_serve, tiny_qwen, sharded, {"use_kernels": False})
    finally:
        sharded.close()


class _Scorer:
    """One process's engine as assert_greedy_equal's reference model: the logits after every prefix."""

    def __init__(self, engine: LLMEngine) -> None:
        self.runner = engine.runner

    def __call__(self, ids: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(logits=self.runner.score(ids[0].tolist())[None])


@pytest.mark.parametrize("quantization", ["gguf", "gguf_exact"])
def test_tp2_on_quantized_weights_equals_tp1(ray_serve, tiny_gguf, quantization):
    """Each rank holds its part of the GGUF blocks (768 intermediate features in 256-weight superblocks: 256 and
    512); the sharded target, speculating, gives the sharded target's plain greedy output token for token, and one
    process's (where the two part, only at a proven near-tie)."""
    from deployments.replica.tp_workers import TPModelRunner, TPSettings
    from smartspec.runtime import kernels

    if kernels.load() is None or (quantization == "gguf" and not kernels.load().q8_linear_available()):
        pytest.skip("needs the CPU kernels (and AVX-512 VNNI for int8 activations)")
    config = EngineConfig(model=tiny_gguf, quantization=quantization, num_kv_blocks=64, max_model_len=256)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "policy": "fixed"}

    def tp2(engine_config: EngineConfig) -> LLMEngine:
        return LLMEngine(engine_config, runner_factory=lambda loaded, blocks: TPModelRunner(
            loaded, blocks, TPSettings(2, quantization=quantization, num_cpus=0.1, num_threads=1)))

    single = LLMEngine(config)
    sharded, sharded_plain = tp2(EngineConfig(**{**config.__dict__, "speculative_config": spec})), tp2(config)
    try:
        down = [ray.get(w.__ray_call__.remote(lambda self: (
            type(self.runner.model.model.layers[0].mlp.down_proj.linear).__name__,
            self.runner.model.model.layers[0].mlp.down_proj.linear.in_features))) for w in sharded.runner.workers]
        kind = "Q8Linear" if quantization == "gguf" else "QuantLinear"
        assert down == [(kind, 256), (kind, 512)]
        speculated = _greedy(sharded)
        assert sum(n for k, n in sharded.stats.chosen_k.items() if k) > 0  # it speculated
        assert speculated == _greedy(sharded_plain)  # lossless on sharded weights: bit for bit, no near-tie needed
        for prompt, ours, ref in zip(PROMPTS, speculated, _greedy(single)):
            assert_greedy_equal(ours, ref, single.tokenize(prompt), _Scorer(single))
        _check_served_tp_app(ray_serve, tiny_gguf, sharded, {"quantization": quantization})
    finally:
        sharded.close()
        sharded_plain.close()


def _check_served_tp_app(url, model, sharded, options):
    """`tensor_parallel_size: 2` in the application config: its workers join the replica's placement group and
    the served text is the sharded engine's."""
    import httpx
    from ray import serve

    from deployments.app import build_app

    args = {"model": model, "served_model_name": "tiny", "speculation": {"method": "none"},
            "tensor_parallel_size": 2, "tp_num_cpus": 0.1, "replica_num_cpus": 0.1, "num_threads": 1,
            "kv_cache_gib": 0.01, "max_model_len": 256, "warmup_profile": False, **options}
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
    from deployments.replica.tp_workers import TPModelRunner, TPSettings

    config = EngineConfig(model=tiny_qwen, num_kv_blocks=64, max_model_len=256, use_kernels=False)
    with pytest.raises(ValueError, match="cannot be split over tensor_parallel_size=3"):
        LLMEngine(config, runner_factory=lambda loaded, blocks: TPModelRunner(
            loaded, blocks, TPSettings(3, num_cpus=0.1, num_threads=1)))
