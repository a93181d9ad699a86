"""A draft model re-quantized to 4-bit blocks at load (quantization "gguf_q4", runtime/requantize.py): each weight
within half a step of the file's, and speculation with such a draft still gives the target's tokens exactly."""
import numpy as np
import pytest
from tiny_gguf import random_tensor

from smartspec import LLM, SamplingParams
from smartspec.runtime import kernels
from smartspec.runtime.gguf_blocks import unpack
from smartspec.runtime.quant_linear import Q8Linear
from smartspec.runtime.requantize import WIDER_THAN_4_BITS, to_q4_1
from smartspec.spec_decode.config import SpeculativeConfig

needs_kernels = pytest.mark.skipif(kernels.load() is None or not kernels.load().q8_linear_available(),
                                   reason="the int8 kernels do not run here")


@pytest.mark.parametrize("kind", sorted(WIDER_THAN_4_BITS))
def test_each_weight_is_within_half_a_step_of_the_files(kind):
    rows = unpack(kind, random_tensor(kind, 24, 512, seed=3), 24, 512)
    q4 = to_q4_1(rows, chunk_rows=7)  # chunks that do not divide the rows
    assert (q4.kind, q4.group, q4.superblock, q4.nibble) == ("Q4_1", 32, 32, True)
    assert q4.q.min() >= 0 and q4.q.max() <= 15
    for scale in (q4.d, q4.off):  # the kernel takes fp16 scales
        assert np.array_equal(scale.astype(np.float16).astype(np.float32), scale)
    w, w4 = rows.dequantize(), q4.dequantize()
    step = np.repeat(q4.d, 32, axis=1)
    # half a step, and what rounding the group's minimum and step to fp16 moves a code's value (~2^-11 relative)
    slack = np.repeat(np.abs(w).reshape(24, -1, 32).max(axis=2), 32, axis=1) * 2 ** -9
    assert (np.abs(w - w4) <= step / 2 + slack).all()
    assert np.abs(w - w4).mean() < np.abs(w).mean() * 0.1


def test_a_draft_quantization_is_checked_and_keys_its_acceptance():
    with pytest.raises(ValueError, match="draft_quantization"):
        SpeculativeConfig(draft_quantization="int3")
    plain, q4 = SpeculativeConfig(), SpeculativeConfig(draft_quantization="gguf_q4")
    assert plain.key != q4.key and q4.key.endswith(":gguf_q4")


@needs_kernels
def test_greedy_speculation_with_a_4_bit_draft_gives_the_targets_tokens(tiny_gguf):
    options = dict(num_kv_blocks=256, block_size=4, max_model_len=256, quantization="gguf")
    prompts = ["hello world", "the quick brown fox", "1 2 3 4"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = LLM(tiny_gguf, **options).generate(prompts, params)
    spec = LLM(tiny_gguf, **options, speculative_config={"method": "draft_model", "model": tiny_gguf,
                                                         "num_speculative_tokens": 3, "policy": "fixed",
                                                         "draft_quantization": "gguf_q4"})
    draft = spec.engine.speculation.proposer.model
    kinds = {m.kind for m in draft.modules() if isinstance(m, Q8Linear)}
    assert "Q4_1" in kinds and not kinds & WIDER_THAN_4_BITS, kinds
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert spec.engine.speculation.metrics.num_draft_tokens > 0
