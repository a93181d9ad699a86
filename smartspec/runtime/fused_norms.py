"""RMSNorm in one kernel on a GPU. transformers' RMSNorm is eight elementwise kernels (cast, square, mean, add,
rsqrt, multiply, cast, scale), 57 of them a step for the default target, and a one-stream decode step on a GPU is
bound by such small kernels (docs/benchmarks.md, "On a GPU"). torch's
`rms_norm` is one kernel on CUDA that normalises in fp32 as transformers does; it scales before the cast back,
transformers after, so the two differ by one rounding of a 16-bit value. Speculation and plain decoding run the
same modules, so the engine's lossless contract is untouched; its output against transformers' own differs only
where a near-tie lets one rounding choose.

A module is swapped only where torch's kernel gives its output on a probe input: a norm of another form (Gemma's
1 + weight, one with an offset or a bias) keeps its own forward."""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

PROBE_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}  # relative, per element


class FusedRMSNorm(nn.Module):
    def __init__(self, weight: nn.Parameter, eps: float) -> None:
        super().__init__()
        self.weight, self.variance_epsilon = weight, eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(hidden_states, self.weight.shape, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, one kernel"


@torch.inference_mode()
def fuse_rms_norms(model: nn.Module) -> int:
    """Every RMSNorm of the model that torch's kernel reproduces, replaced in place by FusedRMSNorm; how many."""
    swapped = kept = 0
    for parent in list(model.modules()):
        for name, norm in list(parent.named_children()):
            if not type(norm).__name__.endswith("RMSNorm") or not hasattr(norm, "variance_epsilon"):
                continue
            fused = FusedRMSNorm(norm.weight, float(norm.variance_epsilon))
            if _same_output(norm, fused):
                setattr(parent, name, fused)
                swapped += 1
            else:
                kept += 1
    if kept:
        logger.info("%d RMSNorm modules keep their own forward (not the plain form torch's kernel computes)", kept)
    return swapped


def _same_output(norm: nn.Module, fused: FusedRMSNorm) -> bool:
    weight = norm.weight
    probe = torch.randn(4, weight.shape[-1], generator=torch.Generator().manual_seed(0)).to(weight.device,
                                                                                          weight.dtype)
    want, got = norm(probe).float(), fused(probe).float()
    return want.shape == got.shape and bool(
        ((got - want).abs() <= PROBE_TOLERANCE.get(weight.dtype, 1e-2) * want.abs().clamp_min(1.0)).all())
