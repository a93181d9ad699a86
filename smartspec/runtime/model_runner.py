"""One packed, ragged forward of the target model per step, attention through the paged KV cache."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from smartspec.runtime.attention import NO_TREE
from smartspec.runtime.backends import ModulesBackend, select_backend
from smartspec.runtime.block_manager import BlockManager
from smartspec.runtime.cuda_graphs import GraphBackend, graphable
from smartspec.runtime.page_arena import PageArena
from smartspec.runtime.step_inputs import StepInputs
from smartspec.types.padding import PaddedShapes
from smartspec.types.request import Request
from smartspec.types.sampling_params import SamplingParams


def kv_heads_per_rank(cfg, tp_size: int) -> int:
    """KV heads each of tp_size tensor-parallel ranks holds; a model whose heads do not split evenly is refused."""
    heads = _kv_geometry(cfg)[1]
    if heads % tp_size:
        raise ValueError(f"{heads} KV heads cannot be split over tensor_parallel_size={tp_size}")
    return heads // tp_size


def _kv_geometry(cfg) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a transformers config."""
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers, kv_heads, head_dim




@dataclass
class ForwardItem:
    """One request's part of a step: `tokens` stored in the cache at start.., and logits wanted for the last
    `num_logits` of them. A token tree's tokens are stored side by side but sit at their depth (`positions`), and
    each sees the cache before `tree_base` plus only the stored tokens its mask's bits name (bit j: tree_base + j)."""
    request: Request
    tokens: list[int]
    start: int
    num_logits: int
    positions: list[int] | None = None  # default: start, start + 1, ...
    tree_base: int | None = None
    tree_masks: list[int] | None = None


def prepare_step(items: list[ForwardItem], blocks: BlockManager) -> StepInputs:
    ids, positions, slots, seq_of, kv_len, keep, tree_base, tree_mask = [], [], [], [], [], [], [], []
    offset = 0
    trees = any(item.tree_masks is not None for item in items)
    for row, item in enumerate(items):
        n = len(item.tokens)
        ids.extend(item.tokens)
        stored = range(item.start, item.start + n)
        positions.extend(item.positions if item.positions is not None else stored)
        slots.extend(blocks.slot(item.request, p) for p in stored)
        seq_of.extend([row] * n)
        kv_len.extend(p + 1 for p in stored)
        keep.extend(range(offset + n - item.num_logits, offset + n))
        if trees:
            tree_base.extend([NO_TREE if item.tree_masks is None else item.tree_base] * n)
            tree_mask.extend(item.tree_masks if item.tree_masks is not None else [0] * n)
        offset += n
    max_blocks = max(len(item.request.block_table) for item in items)
    tables = torch.zeros((len(items), max_blocks), dtype=torch.int32)
    for row, item in enumerate(items):
        tables[row, : len(item.request.block_table)] = torch.tensor(item.request.block_table, dtype=torch.int32)
    return StepInputs(torch.tensor(ids), torch.tensor(positions), torch.tensor(slots, dtype=torch.int64), tables,
                      torch.tensor(seq_of, dtype=torch.int32), torch.tensor(kv_len, dtype=torch.int32),
                      torch.tensor(keep, dtype=torch.long),
                      torch.tensor(tree_base, dtype=torch.int32) if trees else None,
                      torch.tensor(tree_mask, dtype=torch.int64) if trees else None)


class ModelRunner:
    """Runs steps of one model (or one tensor-parallel shard of it: `tp_size` ranks split its KV heads).

    step_graphs: "cuda" replays decode and verify steps as CUDA graphs where the model runs on a GPU through the
    torch attention path, unsharded (cuda_graphs.py); "padded" runs those steps in the same padded buckets eagerly
    (what the CPU tests check); "off" runs every step as it comes."""

    def __init__(self, model: torch.nn.Module, blocks: BlockManager, use_kernels: bool, device: str,
                 tp_size: int = 1, step_graphs: str = "off") -> None:
        self.model = model
        self.blocks = blocks
        self.device = torch.device(device)
        self.num_layers, _, self.head_dim = _kv_geometry(model.config)
        self.num_kv_heads = kv_heads_per_rank(model.config, tp_size)
        self.dtype = next(model.parameters()).dtype
        self.backend = select_backend(model, self.device, use_kernels, tp_size)
        if step_graphs not in ("off", "cuda", "padded"):
            raise ValueError(f"step_graphs must be off, cuda or padded, got {step_graphs!r}")
        graphs = (step_graphs != "off" and tp_size == 1 and isinstance(self.backend, ModulesBackend)
                  and not self.backend.uses_kernels and (step_graphs == "padded" or self.device.type == "cuda")
                  and graphable(model))
        # padded steps write their padding's k/v to a scratch block past the block manager's
        shape = (blocks.num_blocks + graphs, blocks.block_size, self.num_kv_heads, self.head_dim)
        if self.device.type == "cpu":  # in 2 MiB pages, taken as blocks are first written
            zeros = PageArena(2 * self.num_layers * math.prod(shape) * self.dtype.itemsize).zeros
        else:
            def zeros(shape, dtype):
                return torch.zeros(shape, dtype=dtype, device=self.device)
        self.kv_caches = [(zeros(shape, self.dtype), zeros(shape, self.dtype)) for _ in range(self.num_layers)]
        if graphs:
            self.backend = GraphBackend(self.backend, blocks.block_size, scratch_block=blocks.num_blocks,
                                        max_kv_width=blocks.num_blocks * blocks.block_size,
                                        capture=step_graphs == "cuda")

    @staticmethod
    def bytes_per_block(model_config, dtype: torch.dtype, block_size: int) -> int:
        layers, kv_heads, head_dim = _kv_geometry(model_config)
        return 2 * layers * block_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def close(self) -> None:
        """Nothing to stop in-process (a runner over Ray actors stops them)."""

    @torch.inference_mode()
    def copy_kv(self, src_slots: list[int], dst_slots: list[int]) -> None:
        """Move cache entries between slots in every layer (a token tree's accepted path, made contiguous).
        Sources are read before anything is written, so the two may overlap."""
        src = torch.tensor(src_slots, dtype=torch.int64, device=self.device)
        dst = torch.tensor(dst_slots, dtype=torch.int64, device=self.device)
        for caches in self.kv_caches:
            for cache in caches:
                flat = cache.view(-1, self.num_kv_heads, self.head_dim)
                flat.index_copy_(0, dst, flat.index_select(0, src))

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [len, vocab] after every prefix of token_ids, from an empty cache: what the engine's forward
        computes, for perplexity checks. Holds cache blocks only for the call."""
        scratch = Request("score", list(token_ids), SamplingParams(max_tokens=1))
        self.blocks.allocate(scratch, len(token_ids))
        try:
            return self.forward([ForwardItem(scratch, list(token_ids), 0, len(token_ids))])
        finally:
            self.blocks.free(scratch)

    def forward(self, items: list[ForwardItem]) -> torch.Tensor:
        """Run all items in one forward; return logits [sum(num_logits), vocab] in item order (fp32)."""
        return self.execute(prepare_step(items, self.blocks))

    def execute(self, inputs: StepInputs) -> torch.Tensor:
        return self.backend.execute(inputs, self.kv_caches)

    @property
    def padded_shapes(self) -> PaddedShapes | None:
        """The buckets decode and verify steps are padded to (None: every step runs as it comes)."""
        return self.backend.padded_shapes if isinstance(self.backend, GraphBackend) else None

    @property
    def use_kernels(self) -> bool:
        return self.backend.uses_kernels

    @property
    def captures_graphs(self) -> bool:
        """Whether a step of a shape not seen before may include capturing its CUDA graph (a slow first step)."""
        return isinstance(self.backend, GraphBackend) and self.backend.capture and self.backend.enabled
