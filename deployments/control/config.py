"""The application's configuration: the `args:` of config.yaml, validated where it enters (pydantic)."""
from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from smartspec.config import EngineConfig
from smartspec.spec_decode.config import SpeculativeConfig


class Strict(BaseModel):
    # arbitrary types: SpeculativeConfig, the engine's own dataclass, whose policy field may hold a Policy object
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)


class AutoscalingConfig(Strict):
    """Replicas scale between min_replicas and max_replicas (placement/autoscaling.py has the rule)."""
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(2, ge=1)
    # goodput: scale to keep each request at min_speed_fraction of its speed alone, from the replicas' fitted
    # costs; ongoing: Serve's rule, requests / target_ongoing_requests (also goodput's until costs are fitted)
    policy: Literal["goodput", "ongoing"] = "goodput"
    min_speed_fraction: float = Field(0.5, gt=0, le=1)
    target_ongoing_requests: float = Field(8, gt=0)
    upscale_delay_s: float = Field(10.0, ge=0)  # a decision must hold this long before it is carried out
    downscale_delay_s: float = Field(60.0, ge=0)
    look_back_period_s: float = Field(10.0, gt=0)  # the replicas' numbers are averaged over this window

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"autoscaling.min_replicas ({self.min_replicas}) is above max_replicas "
                             f"({self.max_replicas})")
        return self


class AppConfig(Strict):
    model: str = "qwen2.5-coder-1.5b"  # bundled name, local HF directory or hub id
    served_model_name: str | None = None  # the name clients send as "model"; default: `model`
    # the engine's own SpeculativeConfig (draft_model with qwen2.5-coder-0.5b by default); null or
    # {method: none}: no speculation
    speculation: SpeculativeConfig | None = Field(default_factory=SpeculativeConfig)
    # "auto": "gguf" for models whose folder holds a GGUF file (the bundled ones), fp32 under tensor parallelism;
    # "gguf": the target and the draft keep their GGUF block formats (int8 activations, a fraction of the
    # memory); "gguf_exact": the same with fp32 activations (outputs bitwise None's); None: fp32 weights
    quantization: Literal["auto", "gguf", "gguf_exact"] | None = "auto"
    tensor_parallel_size: int = Field(1, ge=1)
    tp_num_cpus: float = Field(0.25, gt=0)  # per tensor-parallel worker actor
    kv_cache_gib: float = Field(1.0, gt=0)
    max_num_seqs: int = Field(16, ge=1)
    max_num_batched_tokens: int = Field(256, ge=1)
    max_model_len: int | None = Field(None, ge=1)
    # torch threads of the engine (and of the draft actor, each TP worker). Default: the node's cores, since Ray
    # sets OMP_NUM_THREADS=1 in actors with fractional CPUs; with several replicas per node, set it.
    num_threads: int | None = Field(None, ge=1)
    use_kernels: bool = True
    device: Literal["cpu", "cuda"] = "cpu"  # cuda: torch attention, no CPU kernels
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: bfloat16 on a GPU, float32 on the CPU
    cuda_graphs: bool = True  # on a GPU: decode and verify steps replayed as CUDA graphs
    max_cuda_graphs: int = Field(96, ge=1)  # buckets a model's runner captures at start (runtime/graph_buckets.py)
    replica_num_gpus: float = Field(0, ge=0)
    num_replicas: int = Field(1, ge=1)
    autoscaling: AutoscalingConfig | None = None  # set: replicas scale by ongoing requests, num_replicas ignored
    replica_num_cpus: float = Field(0.5, gt=0)
    max_replicas_per_node: int | None = Field(None, ge=1)  # e.g. 1: replicas on distinct nodes
    # goodput: requests go where their expected latency is least (prefix cache, queue, request speed;
    # placement/router.py); default: Serve's power-of-two-choices on queue length
    router: Literal["goodput", "default"] = "goodput"
    router_stats_period_s: float = Field(1.0, gt=0)  # how often replicas send the router their costs and prefixes
    drain_timeout_s: float = Field(120.0, ge=0)  # a replica being removed finishes its requests for this long
    # admission: a replica takes at most max_ongoing_requests; beyond that Serve queues up to max_queued_requests
    # per caller and then refuses (503); a replica whose engine already holds max_waiting requests not yet
    # running answers 429
    max_ongoing_requests: int = Field(32, ge=1)
    max_queued_requests: int = Field(64, ge=-1)
    max_waiting: int = Field(64, ge=1)
    # a streamed answer's tokens after its first: sent as they come (0), or gathered and sent at most every this
    # many milliseconds, fewer messages for the ingress and Serve's proxy to carry at a GPU's token rates
    stream_interval_ms: float = Field(0.0, ge=0, le=1000)
    # the streamed answers an ingress replica has on one replica come back by one channel, a message a step for
    # all of them, not one each (needs router: goodput, which sends a channel to its replica; each channel holds
    # one of that replica's max_ongoing_requests while the ingress streams from it)
    stream_channels: bool = True
    controller_interval_s: float = Field(1.0, gt=0)
    # how often a replica checks that the ingress replicas asking for its generations live (replica/orphans.py)
    orphan_check_s: float = Field(1.0, gt=0)
    # a generation waits at most this long for a replica to take it (all replicas restarting after a crash, or
    # all busy); then the caller gets 503 with Retry-After instead of waiting on
    replica_wait_s: float = Field(60.0, gt=0)
    warmup_profile: bool = True
    # a replica keeps its warm-up profile on disk and one restarted on the same machine takes it (a shorter
    # start, and a profile not measured under whatever load the restart meets)
    profile_cache: bool = True
    enable_prefix_caching: bool = True  # reuse the KV of shared prompt prefixes (target and draft)
    # each replica writes every step (shape, k, accepted, predicted and measured time) to Parquet part files in
    # <step_trace_dir>/<replica id>/, readable while it serves; for diagnosing a server and for `smartspec sim`
    step_trace_dir: str | None = None
    # clients must send `Authorization: Bearer <api_key>` (401 otherwise; /health stays open). Unset: the
    # SMARTSPEC_API_KEY environment variable of the ingress's node, if set (better: a config is shown by Serve's
    # dashboard and API, an environment variable is not); neither: no key, for a server on localhost
    api_key: str | None = Field(None, min_length=1)
    metrics_need_key: bool = False  # /metrics asks for the key too (Prometheus then sends it as a bearer token)

    @field_validator("speculation", mode="before")
    @classmethod
    def _speculation(cls, v):
        spec = SpeculativeConfig.parse(v)  # unknown keys and bad values named, with the engine's own checks
        if spec is not None and not isinstance(spec.policy, str):
            raise ValueError("speculation.policy must be a policy name in a served config")
        return spec

    @field_validator("step_trace_dir")
    @classmethod
    def _absolute(cls, v: str | None) -> str | None:
        if v is not None and not os.path.isabs(v):
            raise ValueError(f"step_trace_dir must be an absolute path (replicas run in Ray's working directory): "
                             f"{v!r}")
        return v

    @field_validator("model")
    @classmethod
    def _non_empty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("model must be a non-empty string")
        return v

    @model_validator(mode="after")
    def _check(self) -> AppConfig:
        self.engine_config()  # the engine's own checks, now, with a clear message
        return self

    @property
    def threads(self) -> int:
        return self.num_threads or os.cpu_count() or 1

    @property
    def name(self) -> str:
        return self.served_model_name or self.model

    @property
    def draft_actor(self) -> bool:
        """Whether the draft model runs in its own Ray actor."""
        spec = self.speculation
        return spec is not None and "draft_model" in spec.all_methods and spec.draft_actor

    def engine_config(self, replica_id: str = "replica") -> EngineConfig:
        trace = os.path.join(self.step_trace_dir, replica_id) if self.step_trace_dir else None
        return EngineConfig(model=self.model, kv_cache_gib=self.kv_cache_gib, max_num_seqs=self.max_num_seqs,
                            max_num_batched_tokens=self.max_num_batched_tokens, max_model_len=self.max_model_len,
                            num_threads=self.threads, use_kernels=self.use_kernels, device=self.device,
                            dtype=self.dtype, cuda_graphs=self.cuda_graphs,
                            max_cuda_graphs=self.max_cuda_graphs, quantization=self.quantization,
                            speculative_config=self.speculation, warmup_profile=self.warmup_profile,
                            profile_cache=self.profile_cache,
                            trace_path=trace, enable_prefix_caching=self.enable_prefix_caching)
