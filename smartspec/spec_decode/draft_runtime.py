"""What a draft model is built with beside its name: the engine makes one (LLMEngine.draft_runtime), the draft
model's proposer and the draft actor take it whole."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from smartspec.runtime.graph_buckets import BucketLimits


@dataclass(frozen=True)
class DraftRuntime:
    """What a draft model is built with beside its name: the target's vocabulary (the draft must share its
    tokenizer) and the engine's runtime options, with the draft's own KV cache size."""
    target_tokenizer: Any  # None where the builder loads it (the draft actor loads it by the target's name)
    target_vocab_size: int
    num_blocks: int
    block_size: int
    use_kernels: bool
    dtype: str = "float32"
    device: str = "cpu"
    quantization: str | None = None
    enable_prefix_caching: bool = False
    bucket_limits: BucketLimits | None = None  # the steps a draft runner's CUDA graphs cover; None: no graphs
