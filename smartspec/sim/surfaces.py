"""Step-cost surfaces of the machines the default pair (Qwen2.5-Coder-1.5B, its 0.5B as draft) was measured on,
for simulating them (scripts/bench_oracle.py). Coefficients as StepCostModel holds them (seconds):
v = [base, a token's cost within each of SEGMENTS, a context token], d = [a draft forward, a draft token, a catch-up
token]. Where each comes from is docs/policy.md's ("The policy against an oracle"); the noise is what these
machines' step traces show: a few per cent of jitter, and now and then a stall."""
from __future__ import annotations

from dataclasses import dataclass

from smartspec.policy.cost_model import StepCostModel
from smartspec.sim.profile import SimProfile
from smartspec.sim.realism import StepNoise


@dataclass(frozen=True)
class Surface:
    name: str
    verify: tuple[float, ...]  # v0, six segment slopes, v_c
    draft: tuple[float, float, float]  # d0, d1, d2
    noise: StepNoise
    padded: bool  # a CUDA-graph runner (a GPU's): the warm-up profile also runs its row buckets

    def profile(self) -> SimProfile:
        cost = StepCostModel()
        cost.v, cost.d = list(self.verify), list(self.draft)
        return SimProfile(cost, [], f"surface {self.name}", asynchronous=self.padded)  # a GPU runs the forward


CPU_NOISE = StepNoise(sigma=0.05, stall_p=0.01, stall_factor=(1.5, 4.0))
GPU_NOISE = StepNoise(sigma=0.02, stall_p=0.002, stall_factor=(1.5, 3.0))

SURFACES = {s.name: s for s in (
    # NVIDIA H200, bf16, CUDA graphs (docs/benchmarks.md, "On a GPU"): one token 4.3 ms, five 4.67 ms; 64 rows 7.4 ms,
    # 320 rows with four 4-layer draft forwards 20.0 ms; a draft forward ~1 ms
    Surface("h200", (4.2e-3, 9.0e-5, 4.45e-5, 4.45e-5, 4.45e-5, 2.6e-5, 2.6e-5, 2e-9), (1.0e-3, 7.6e-6, 1e-6),
            GPU_NOISE, True),
    # Intel Xeon VM, 2 vCPUs, AVX-512 VNNI (bench_step, 2026-11-26): one token ~52 ms, 8 rows 1.46x; a draft
    # token 20.8 ms (bench_draft_quant), more rows ~2 ms each; a catch-up token ~2.5 ms
    Surface("xeon", (48.6e-3, 3.4e-3, 5.5e-3, 5.5e-3, 5.0e-3, 4.5e-3, 4.5e-3, 2.3e-6), (18.8e-3, 2.0e-3, 2.5e-3),
            CPU_NOISE, False),
    # AMD EPYC Zen 4 VM, 2 vCPUs (bench_step, 2026-11-29): one token 48.4 ms, 8 rows 82.5, 16 rows 134; the draft
    # 18.7 ms a forward, 22.7 at 4 rows, 33.9 at 8; a catch-up token ~2.5 ms (an 1,800-token prompt: 4.2-4.7 s)
    Surface("zen4", (43.5e-3, 4.87e-3, 6.44e-3, 6.44e-3, 5.5e-3, 5.0e-3, 5.0e-3, 2.3e-6), (15.1e-3, 1.9e-3, 2.5e-3),
            CPU_NOISE, False),
)}
