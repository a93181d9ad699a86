"""Engine configuration, validated where it enters."""
from __future__ import annotations

import re
from dataclasses import dataclass

from smartspec.models.loader import QUANTIZATIONS
from smartspec.spec_decode.config import SpeculativeConfig
from smartspec.types.numbers import is_int


@dataclass
class EngineConfig:
    model: str = "qwen2.5-coder-1.5b"
    # KV cache: a number of blocks, or else a size in GiB.
    num_kv_blocks: int | None = None
    kv_cache_gib: float = 1.0
    block_size: int = 16
    max_num_seqs: int = 16
    # Tokens one step may run (decode tokens plus prefill chunks): bounds a step's latency.
    max_num_batched_tokens: int = 256
    max_model_len: int | None = None  # default: the model's context, capped at 4096
    num_threads: int | None = None  # torch threads for this engine; default: torch's choice
    seed: int = 0
    # The batch-invariant CPU kernels (fp32). False runs transformers' own linears and a torch attention.
    use_kernels: bool = True
    # "auto": bfloat16 on a GPU, float32 on the CPU (the CPU kernels compute in fp32); or float32, bfloat16, float16
    dtype: str = "auto"
    device: str = "cpu"  # "cpu", "cuda" or "cuda:N"
    # On a GPU, replay decode and verify steps as CUDA graphs in padded buckets (runtime/cuda_graphs.py), every
    # bucket captured at start; a bucket whose capture fails turns them off with a warning. Ignored on the CPU.
    cuda_graphs: bool = True
    # The most buckets (graphs) a model's runner captures: the planned set covers every decode and verify step
    # within it, coarser where the cap is lower (runtime/graph_buckets.py)
    max_cuda_graphs: int = 96
    # "auto": "gguf" for a model folder that holds a GGUF file (the bundled models), else None. "gguf": the
    # weights stay in the GGUF block formats and linears compute from them with int8 activations (llama.cpp's
    # numerics, AVX-512 VNNI); "gguf_exact": the same weights with fp32 activations, outputs bit for bit those of
    # None: fp32 weights (the folder's safetensors). The GGUF modes need the CPU kernels.
    quantization: str | None = "auto"
    # Speculative decoding: None, or a SpeculativeConfig or its dict ({"method": "draft_model" | "ngram",
    # "model": <draft>, "num_speculative_tokens": K, "policy": "smartspec" | "off" | ..., ...})
    speculative_config: SpeculativeConfig | dict | None = None
    # write every step's record: to this Parquet file (*.parquet, complete at close), or to part files in this
    # directory (any other path; each part complete when written, for a server)
    trace_path: str | None = None
    # Seed a learning policy's cost model with a few measured step shapes at start (a few seconds on CPU).
    warmup_profile: bool = True
    # Keep that profile on disk (under $SMARTSPEC_CACHE/profiles, per configuration and machine) and take it from
    # there when an engine of the same configuration starts again on this machine (engine/profile_cache.py).
    profile_cache: bool = False
    # Reuse the KV of full blocks whose tokens (and every token before them) an earlier request computed, in the
    # target's cache and the draft model's: a shared system prompt is prefilled once.
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if not is_int(value) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        if not isinstance(self.model, str) or not self.model.strip():
            raise ValueError("model must be a non-empty string (a bundled name, a directory or a hub id)")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_cuda_graphs"):
            positive(name)
        for name in ("num_kv_blocks", "max_model_len", "num_threads"):
            if getattr(self, name) is not None:
                positive(name)
        if self.num_kv_blocks is None and not self.kv_cache_gib > 0:
            raise ValueError(f"kv_cache_gib must be > 0, got {self.kv_cache_gib!r}")
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.quantization == "auto" and not self.use_kernels:
            self.quantization = None  # the GGUF modes compute on the kernels
        if not isinstance(self.device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if not isinstance(self.profile_cache, bool):
            raise ValueError(f"profile_cache must be true or false, got {self.profile_cache!r}")
        if not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"cuda_graphs must be true or false, got {self.cuda_graphs!r}")
        if self.dtype == "auto":
            self.dtype = "float32" if self.device == "cpu" else "bfloat16"
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
