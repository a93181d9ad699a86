"""A model built from its GGUF file with the weights left quantized (real SmolLM2-135M: Llama architecture, Q4_1
linears, a Q8_0 embedding tied to the output layer): with fp32 activations ("gguf_exact") the same tokens, bit for
bit, as the fp32 model dequantized from the same file; with int8 activations ("gguf") a perplexity within 1% of
it, and speculation on either equal to its own plain decoding."""
import math

import pytest
import torch

from smartspec import LLM, SamplingParams
from smartspec.engine import kernels
from smartspec.models.gguf_model import hf_name
from smartspec.models.loader import load_model

PROMPTS = ["def quicksort(arr):", "The capital of France is", "Write a haiku about the sea.\n", "1, 2, 3, 4,"]
needs_kernels = pytest.mark.skipif(kernels.load() is None,
                                   reason=f"kernels unavailable: {kernels.unavailable_reason()}")


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
    from smartspec.engine.quant_linear import Q8Linear, QuantLinear
    from smartspec.models.loader import auto_quantization

    assert auto_quantization(smollm) == "gguf"
    assert auto_quantization(smollm, dtype="bfloat16") is None
    assert auto_quantization(tiny_qwen) is None
    assert LLM(smollm, use_kernels=False, **OPTIONS).engine.config.quantization is None
    layer = LLM(smollm, **OPTIONS).engine.model.model.layers[0].mlp.down_proj
    assert isinstance(layer, Q8Linear if kernels.load().q8_linear_available() else QuantLinear)


def test_quantized_loading_needs_a_gguf_file(tiny_qwen):
    with pytest.raises(ValueError, match="exactly one .gguf file"):
        LLM(tiny_qwen, quantization="gguf", num_kv_blocks=64, block_size=4, max_model_len=128)
    with pytest.raises(ValueError, match=r"quantization must be one of \(None, 'auto', 'gguf', 'gguf_exact'\)"):
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


@pytest.mark.real_model
@needs_kernels
def test_int8_activations_keep_perplexity_within_one_percent(smollm):
    text = " ".join(PROMPTS) + " def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + " \
        "fibonacci(n - 2)\n\nprint([fibonacci(i) for i in range(10)])\n"
    dense = perplexity(smollm, None, text)
    assert abs(perplexity(smollm, "gguf", text) / dense - 1) < 0.01


@pytest.mark.real_model
@needs_kernels
@pytest.mark.parametrize("quantization", ["gguf", "gguf_exact"])
def test_speculation_on_the_quantized_model_equals_its_plain_decoding(smollm, pair, int8_model, quantization):
    plain = int8_model if quantization == "gguf" else pair[0]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    spec = LLM(smollm, quantization=quantization, **OPTIONS,
               speculative_config={"method": "ngram", "num_speculative_tokens": 5, "policy": "fixed"})
    outs = spec.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(PROMPTS, params)]
    assert spec.engine.speculator.metrics.num_draft_tokens > 0
