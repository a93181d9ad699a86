"""RMSNorm in one kernel (runtime/fused_norms.py), the GPU path's: every plain RMSNorm of a model swapped, its
outputs those of transformers' form within the dtype's rounding, and a norm of another form kept."""
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from smartspec.runtime.fused_norms import FusedRMSNorm, fuse_rms_norms


def test_every_plain_rms_norm_is_swapped_and_the_logits_stay(tiny_qwen, tiny_llama_tied):
    for path in (tiny_qwen, tiny_llama_tied):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            want = model(ids).logits
        layers = model.config.num_hidden_layers
        assert fuse_rms_norms(model) == 2 * layers + 1  # two a layer and the final norm
        assert sum(isinstance(m, FusedRMSNorm) for m in model.modules()) == 2 * layers + 1
        with torch.inference_mode():
            got = model(ids).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_in_bf16_the_fused_norm_differs_from_transformers_by_a_rounding_at_most(tiny_qwen):
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen, dtype=torch.bfloat16).eval()
    norm = model.model.norm
    x = torch.randn(64, norm.weight.shape[0], generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.inference_mode():
        want = norm(x)
        got = FusedRMSNorm(norm.weight, norm.variance_epsilon)(x)
    assert got.dtype == want.dtype == torch.bfloat16
    assert (got.float() - want.float()).abs().max() <= 2 ** -7 * want.float().abs().max()


class OffsetRMSNorm(nn.Module):
    """Gemma's form: the scale is 1 + weight."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight, self.variance_epsilon = nn.Parameter(torch.zeros(size)), 1e-6

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * (1 + self.weight)


def test_a_norm_of_another_form_keeps_its_forward():
    model = nn.Sequential(OffsetRMSNorm(32), nn.Linear(32, 32))
    assert fuse_rms_norms(model) == 0
    assert isinstance(model[0], OffsetRMSNorm)
