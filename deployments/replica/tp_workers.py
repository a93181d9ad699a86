"""Tensor parallelism for the target: N rank actors hold one shard each and a KV cache for their share of the
heads, over torch.distributed (gloo on CPU, nccl on GPU). GGUF weights stay quantized, each rank loading its part
(smartspec/models/gguf_shard.py) and computing on the kernels; other weights shard by transformers' tensor
parallelism. The replica keeps the scheduler and block tables and drives every rank each step with the same
packed inputs; rank 0 returns the logits (every rank computes the full logits)."""
from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass

import ray
import torch

from smartspec.models.loader import LoadedModel
from smartspec.runtime.block_manager import BlockManager
from smartspec.runtime.model_runner import ForwardItem, kv_heads_per_rank, prepare_step
from smartspec.runtime.step_inputs import StepInputs

logger = logging.getLogger(__name__)


def _init_process_group(backend: str, address: str, port: int, rank: int, world: int) -> None:
    # module-level on purpose: an actor method that touches torch.distributed failed to pickle on this setup
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR=address, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank) if backend == "gloo" else "0")  # Ray shows each actor its GPU as 0
    dist.init_process_group(backend, rank=rank, world_size=world)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class TPWorker:
    def __init__(self, rank: int, world: int, num_threads: int | None) -> None:
        self.rank, self.world = rank, world
        if num_threads:
            torch.set_num_threads(num_threads)
        self.runner = None

    def address(self) -> tuple[str, int]:
        return ray.util.get_node_ip_address(), _free_port()

    def setup(self, model: str, dtype: str, device: str, num_blocks: int, block_size: int, address: str,
              port: int, quantization: str | None = None) -> int:
        from smartspec.models import load_model
        from smartspec.models.gguf_shard import Shard
        from smartspec.models.loader import auto_quantization
        from smartspec.runtime.model_runner import ModelRunner

        _init_process_group("nccl" if device.startswith("cuda") else "gloo", address, port, self.rank, self.world)
        if quantization == "auto":
            quantization = auto_quantization(model, device, dtype)
        if quantization in ("gguf", "gguf_exact"):
            loaded = load_model(model, dtype, device, quantization=quantization, shard=Shard(self.rank, self.world))
        else:
            loaded = load_model(model, dtype, device, tp_plan="auto")
        # GGUF shards compute on the kernels; transformers' sharded linears must not be packed (that would drop
        # their all-reduce hooks)
        self.runner = ModelRunner(loaded.model, BlockManager(num_blocks, block_size),
                                  use_kernels=quantization is not None, device=device, tp_size=self.world)
        return self.runner.num_kv_heads

    def execute(self, inputs: StepInputs) -> torch.Tensor | None:
        logits = self.runner.execute(inputs)
        return logits if self.rank == 0 else None

    def copy_kv(self, src_slots: list[int], dst_slots: list[int]) -> None:
        self.runner.copy_kv(src_slots, dst_slots)


@dataclass(frozen=True)
class TPSettings:
    """The ranks of a sharded target: how many, the weights' dtype, device and format, and each rank actor's
    Ray resources and torch threads."""
    size: int
    dtype: str = "float32"
    device: str = "cpu"
    quantization: str | None = None
    num_cpus: float = 0.25
    num_gpus: float = 0
    num_threads: int | None = None


class TPModelRunner:
    """Stands in for the engine's ModelRunner: same forward(items) -> logits, computed by the rank actors."""
    padded_shapes = None  # and unpadded

    def __init__(self, loaded: LoadedModel, blocks: BlockManager, settings: TPSettings) -> None:
        tp_size, dtype, device, quantization = settings.size, settings.dtype, settings.device, settings.quantization
        num_cpus, num_gpus, num_threads = settings.num_cpus, settings.num_gpus, settings.num_threads
        self.blocks = blocks
        try:  # refuse here, before any worker starts
            kv_heads_per_rank(loaded.config, tp_size)
        except ValueError as exc:
            raise ValueError(f"{loaded.path}: {exc}") from None
        actor = ray.remote(TPWorker).options(num_cpus=num_cpus, num_gpus=num_gpus)
        self.workers = [actor.remote(rank, tp_size, num_threads) for rank in range(tp_size)]
        address, port = ray.get(self.workers[0].address.remote())
        ray.get([w.setup.remote(loaded.path, dtype, device, blocks.num_blocks, blocks.block_size, address, port,
                                quantization) for w in self.workers])
        logger.info("tensor parallel target ready on %d ranks (%s:%d)", tp_size, address, port)

    def forward(self, items: list[ForwardItem]) -> torch.Tensor:
        inputs = ray.put(prepare_step(items, self.blocks))
        return ray.get([w.execute.remote(inputs) for w in self.workers])[0]

    def copy_kv(self, src_slots: list[int], dst_slots: list[int]) -> None:
        ray.get([w.copy_kv.remote(src_slots, dst_slots) for w in self.workers])

    def close(self) -> None:
        for w in self.workers:
            ray.kill(w)
