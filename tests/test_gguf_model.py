"""A model built from its GGUF file with the weights left quantized: the same tokens, bit for bit, as the fp32
model dequantized from the same file (real SmolLM2-135M: Llama architecture, Q4_1 linears, a Q8_0 embedding tied
to the output layer)."""
import pytest

from smartspec import LLM, SamplingParams
from smartspec.engine import kernels
from smartspec.models.gguf_model import hf_name

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


def test_quantized_loading_needs_a_gguf_file(tiny_qwen):
    with pytest.raises(ValueError, match="exactly one .gguf file"):
        LLM(tiny_qwen, quantization="gguf", num_kv_blocks=64, block_size=4, max_model_len=128)
    with pytest.raises(ValueError, match=r"quantization must be one of \(None, 'gguf'\)"):
        LLM(tiny_qwen, quantization="awq")


@pytest.fixture(scope="module")
def pair(smollm):
    options = dict(kv_cache_gib=0.25, max_model_len=1024)
    return LLM(smollm, quantization="gguf", **options), LLM(smollm, **options)


@pytest.mark.real_model
@needs_kernels
def test_quantized_model_generates_the_fp32_models_tokens(pair):
    quantized, dense = pair
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    assert [o.token_ids for o in quantized.generate(PROMPTS, params)] == \
        [o.token_ids for o in dense.generate(PROMPTS, params)]
    seeded = SamplingParams(max_tokens=16, temperature=0.9, seed=3, ignore_eos=True)
    assert [o.token_ids for o in quantized.generate(PROMPTS, seeded)] == \
        [o.token_ids for o in dense.generate(PROMPTS, seeded)]


@pytest.mark.real_model
@needs_kernels
def test_speculation_on_the_quantized_model_equals_its_plain_decoding(smollm, pair):
    quantized, _ = pair
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    spec = LLM(smollm, quantization="gguf", kv_cache_gib=0.25, max_model_len=1024,
               speculative_config={"method": "ngram", "num_speculative_tokens": 5, "policy": "fixed"})
    outs = spec.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in quantized.generate(PROMPTS, params)]
    assert spec.engine.speculator.metrics.num_draft_tokens > 0
