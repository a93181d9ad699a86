"""A model built from its GGUF file with the weights left quantized (real SmolLM2-135M: Llama architecture, Q4_1
linears, a Q8_0 embedding tied to the output layer): with fp32 activations ("gguf_exact") the same tokens, bit for
bit, as the fp32 model dequantized from the same file; with int8 activations ("gguf") a perplexity within 1% of
it, and speculation on either equal to its own plain decoding."""
import math
from pathlib import Path

import pytest
import torch

from smartspec import LLM, SamplingParams
from smartspec.models.gguf_model import hf_name
from smartspec.models.loader import load_model
from smartspec.runtime import kernels
from smartspec.runtime.backends import FusedKernelBackend, ModulesBackend

PROMPTS = ["def quicksort(arr):", "The capital of France is", "Write a haiku about the sea.\n", "1, 2, 3, 4,"]
needs_kernels = pytest.mark.skipif(kernels.load() is None,
                                   reason=f"kernels unavailable: {kernels.unavailable_reason()}")
needs_vnni = pytest.mark.skipif(kernels.load() is None or not kernels.load().q8_linear_available(),
                                reason="no AVX-512 VNNI here: quantization gguf computes with fp32 activations")


def test_gguf_tensor_names_map_to_transformers_names():
    assert hf_name("blk.3.attn_q.bias") == "model.layers.3.self_attn.q_proj.bias"
    assert hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    with pytest.raises(ValueError, match="no place"):
        hf_name("blk.0.ffn_gate_exps.weight")


@pytest.mark.real_model
@needs_kernels
def test_auto_quantization_picks_the_gguf_file_where_there_is_one(tiny_qwen, smollm):
    from smartspec.models.loader import auto_quantization
    from smartspec.runtime.quant_linear import Q8Linear, QuantLinear

    assert auto_quantization(smollm) == "gguf"
    assert auto_quantization(smollm, dtype="bfloat16") is None
    assert auto_quantization(tiny_qwen) is None
    assert LLM(smollm, use_kernels=False, **OPTIONS).engine.config.quantization is None
    layer = LLM(smollm, **OPTIONS).engine.model.model.layers[0].mlp.down_proj
    assert isinstance(layer, Q8Linear if kernels.load().q8_linear_available() else QuantLinear)


def test_quantized_loading_needs_a_gguf_file(tiny_qwen):
    with pytest.raises(ValueError, match="exactly one .gguf file"):
        LLM(tiny_qwen, quantization="gguf", num_kv_blocks=64, block_size=4, max_model_len=128)
    known = r"\(None, 'auto', 'gguf', 'gguf_exact', 'gguf_q4'\)"
    with pytest.raises(ValueError, match=f"quantization must be one of {known}"):
        LLM(tiny_qwen, quantization="awq")


OPTIONS = {"kv_cache_gib": 0.25, "max_model_len": 1024}


@pytest.fixture(scope="module")
def pair(smollm):
    return LLM(smollm, quantization="gguf_exact", **OPTIONS), LLM(smollm, quantization=None, **OPTIONS)


@pytest.fixture(scope="module")
def int8_model(smollm):
    return LLM(smollm, quantization="gguf", **OPTIONS)


@pytest.mark.real_model
@needs_kernels
def test_exact_quantized_model_generates_the_fp32_models_tokens(pair):
    quantized, dense = pair
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    assert [o.token_ids for o in quantized.generate(PROMPTS, params)] == \
        [o.token_ids for o in dense.generate(PROMPTS, params)]
    seeded = SamplingParams(max_tokens=16, temperature=0.9, seed=3, ignore_eos=True)
    assert [o.token_ids for o in quantized.generate(PROMPTS, seeded)] == \
        [o.token_ids for o in dense.generate(PROMPTS, seeded)]


@torch.inference_mode()
def perplexity(model: str, quantization: str | None, text: str) -> float:
    loaded = load_model(model, quantization=quantization)  # transformers' own attention: a plain forward
    ids = torch.tensor([loaded.tokenizer(text)["input_ids"]])
    logits = loaded.model(input_ids=ids).logits[0, :-1]
    return math.exp(torch.nn.functional.cross_entropy(logits, ids[0, 1:]).item())


def fixed_text() -> str:
    """HumanEval's first problems with their solutions: some 900 tokens of code, a fixed text."""
    from smartspec.bench.workloads import humaneval_problems

    return "\n\n".join(p["prompt"] + p["canonical_solution"] for p in humaneval_problems()[:6])


def engine_perplexity(llm: LLM, text: str) -> float:
    ids = llm.tokenizer(text)["input_ids"]
    logits = llm.engine.runner.score(ids)[:-1]
    return math.exp(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:])).item())


@pytest.mark.real_model
@needs_vnni
def test_int8_activations_keep_perplexity_within_one_percent(smollm, pair, int8_model):
    """transformers' forward on the int8 linears, and the engine's (the fused decoder layers, and the same layers
    through transformers' modules), each within 1% of the fp32 model's."""
    text = fixed_text()
    dense = perplexity(smollm, None, text)
    assert abs(perplexity(smollm, "gguf", text) / dense - 1) < 0.01
    runner = int8_model.engine.runner
    fused_backend = runner.backend
    assert isinstance(fused_backend, FusedKernelBackend)  # SmolLM2 is a Llama: its layers run fused
    engine_dense = engine_perplexity(pair[1], text)
    fused = engine_perplexity(int8_model, text)
    runner.backend = ModulesBackend(int8_model.engine.model, runner.device, uses_kernels=True)
    try:
        modules = engine_perplexity(int8_model, text)
    finally:
        runner.backend = fused_backend
    assert abs(fused / engine_dense - 1) < 0.01 and abs(modules / engine_dense - 1) < 0.01
    assert abs(engine_dense / dense - 1) < 0.01


@pytest.mark.real_model
@needs_kernels
@pytest.mark.parametrize("quantization, tree", [("gguf", None), ("gguf", {"max_nodes": 8, "max_depth": 3}),
                                               ("gguf_exact", None)])
def test_speculation_on_the_quantized_model_equals_its_plain_decoding(smollm, pair, int8_model, quantization, tree):
    plain = int8_model if quantization == "gguf" else pair[0]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    shape = {"tree": tree} if tree else {"num_speculative_tokens": 5}
    spec = LLM(smollm, quantization=quantization, **OPTIONS,
               speculative_config={"method": "ngram", "policy": "fixed", **shape})
    outs = spec.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(PROMPTS, params)]
    assert spec.engine.speculation.metrics.num_draft_tokens > 0


@pytest.mark.real_model
@needs_kernels
def test_a_fetched_model_gets_fp32_weights_only_when_they_are_loaded(smollm, tmp_path):
    """The store keeps the GGUF file with config and tokenizer; quantization None converts it once, on first use."""
    from smartspec.models.registry import needs_dense

    folder = tmp_path / "smollm"
    folder.mkdir()
    for item in Path(smollm).iterdir():
        if not item.name.endswith(".safetensors") and item.is_file():
            (folder / item.name).symlink_to(item)
    assert needs_dense(str(folder))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    quantized = LLM(str(folder), quantization="gguf_exact", **OPTIONS).generate(PROMPTS[:2], params)
    assert needs_dense(str(folder))  # serving the GGUF blocks needs no conversion
    dense = LLM(str(folder), quantization=None, **OPTIONS).generate(PROMPTS[:2], params)
    assert not needs_dense(str(folder)) and (folder / "model.safetensors").stat().st_size > 4 * 10**8
    assert [o.token_ids for o in dense] == [o.token_ids for o in quantized]


def test_a_shard_plan_splits_on_whole_blocks_or_refuses():
    from types import SimpleNamespace

    from smartspec.models.gguf_shard import Shard, ShardPlan, split

    assert split(8960, 2, 256) == [0, 4352, 8960]  # 35 superblocks: 17 and 18
    assert split(4864, 2, 32) == [0, 2432, 4864]
    with pytest.raises(ValueError, match="do not split into 2 slices of whole 256-weight blocks"):
        split(8000, 2, 256)
    qwen15 = SimpleNamespace(num_attention_heads=12, num_key_value_heads=2, hidden_size=1536, intermediate_size=8960,
                             num_hidden_layers=2)
    plan = ShardPlan(qwen15, Shard(1, 2), lambda module: 256)
    assert plan.rows("model.layers.1.self_attn.q_proj") == slice(768, 1536)
    assert plan.rows("model.layers.1.self_attn.k_proj") == slice(128, 256)
    assert plan.rows("model.layers.0.mlp.up_proj") == plan.columns("model.layers.0.mlp.down_proj") == slice(4352, 8960)
    assert plan.columns("model.layers.0.self_attn.o_proj") == slice(768, 1536)
    assert plan.rows("lm_head") is None and plan.columns("model.layers.0.mlp.down_proj.linear") is None
    bias = torch.arange(1536.0)
    assert plan.bias("model.layers.0.self_attn.o_proj", bias) is None  # added once, by rank 0
    assert torch.equal(plan.bias("model.layers.0.self_attn.q_proj", bias), bias[768:])
    with pytest.raises(ValueError, match="2 KV heads cannot be split over tensor_parallel_size=3"):
        ShardPlan(qwen15, Shard(0, 3), lambda module: 256)
    wide = SimpleNamespace(**{**qwen15.__dict__, "num_key_value_heads": 4})
    with pytest.raises(ValueError, match="o_proj: a rank's 3 heads .384 inputs. are not whole 256-weight blocks"):
        ShardPlan(wide, Shard(0, 4), lambda module: 256)
