"""One packed, ragged forward of the target model per step, attention through the paged KV cache."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import torch

from smartspec.runtime.attention import NO_TREE
from smartspec.runtime.backends import ModulesBackend, select_backend
from smartspec.runtime.block_manager import BlockManager
from smartspec.runtime.cuda_graphs import GraphBackend, graphable
from smartspec.runtime.graph_buckets import BucketLimits, plan_buckets
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
    """The step's packed inputs, built over the step's tokens at once (numpy), not token by token: at 256 requests
    drafting 4 tokens, a Python loop over the tokens was most of the engine's host time outside the commit."""
    rows = len(items)
    counts = np.fromiter((len(item.tokens) for item in items), np.int64, rows)
    starts = np.fromiter((item.start for item in items), np.int64, rows)
    num_logits = np.fromiter((item.num_logits for item in items), np.int64, rows)
    total = int(counts.sum())
    seq_of = np.repeat(np.arange(rows, dtype=np.int64), counts)
    first = np.cumsum(counts) - counts  # each item's first token in the step
    within = np.arange(total, dtype=np.int64) - first[seq_of]  # each token's place in its item
    stored = starts[seq_of] + within  # where its k/v is stored
    widths = [len(item.request.block_table) for item in items]
    tables = np.zeros((rows, max(widths)), dtype=np.int32)
    for row, item in enumerate(items):
        tables[row, :widths[row]] = item.request.block_table.array()
    block = stored // blocks.block_size
    if (block >= np.asarray(widths, dtype=np.int64)[seq_of]).any():
        raise IndexError("a token is stored past its request's block table")
    slots = tables[seq_of, block].astype(np.int64) * blocks.block_size + stored % blocks.block_size
    positions = stored
    placed = [row for row, item in enumerate(items) if item.positions is not None]  # a tree's nodes sit at depth
    if placed:
        positions = stored.copy()
        for row in placed:
            positions[first[row]:first[row] + counts[row]] = items[row].positions
    tree_base = tree_mask = None
    if any(item.tree_masks is not None for item in items):
        bases = [NO_TREE if item.tree_masks is None else item.tree_base for item in items]
        tree_base = torch.from_numpy(np.repeat(np.asarray(bases, dtype=np.int32), counts))
        tree_mask = torch.from_numpy(np.fromiter(itertools.chain.from_iterable(
            item.tree_masks if item.tree_masks is not None else [0] * len(item.tokens) for item in items),
            np.int64, total))
    ids = np.fromiter(itertools.chain.from_iterable(item.tokens for item in items), np.int64, total)
    keep = np.flatnonzero(within >= (counts - num_logits)[seq_of])
    return StepInputs(torch.from_numpy(ids), torch.from_numpy(positions), torch.from_numpy(slots),
                      torch.from_numpy(tables), torch.from_numpy(seq_of.astype(np.int32)),
                      torch.from_numpy((stored + 1).astype(np.int32)), torch.from_numpy(keep.astype(np.int64)),
                      tree_base, tree_mask)


class ModelRunner:
    """Runs steps of one model (or one tensor-parallel shard of it: `tp_size` ranks split its KV heads).

    step_graphs: "cuda" replays decode and verify steps as CUDA graphs where the model runs on a GPU through the
    torch attention path, unsharded (cuda_graphs.py); "padded" runs those steps in the same padded buckets eagerly
    (what the CPU tests check); "off" runs every step as it comes. bucket_limits: the steps the scheduler can form,
    which the buckets cover (runtime/graph_buckets.py); needed where step_graphs is not "off"."""

    def __init__(self, model: torch.nn.Module, blocks: BlockManager, use_kernels: bool, device: str,
                 tp_size: int = 1, step_graphs: str = "off", bucket_limits: BucketLimits | None = None) -> None:
        self.model = model
        self.blocks = blocks
        self.device = torch.device(device)
        self.num_layers, _, self.head_dim = _kv_geometry(model.config)
        self.num_kv_heads = kv_heads_per_rank(model.config, tp_size)
        self.dtype = next(model.parameters()).dtype
        self.backend = select_backend(model, self.device, use_kernels, tp_size)
        if step_graphs not in ("off", "cuda", "padded"):
            raise ValueError(f"step_graphs must be off, cuda or padded, got {step_graphs!r}")
        if step_graphs != "off" and bucket_limits is None:
            raise ValueError(f"step_graphs={step_graphs!r} needs bucket_limits")
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
        self.bucket_limits = bucket_limits if graphs else None  # None: steps run as they come
        if graphs:
            self.backend = GraphBackend(self.backend, plan_buckets(bucket_limits), blocks.block_size,
                                        scratch_block=blocks.num_blocks, capture=step_graphs == "cuda")
            self.backend.warm_up(self.kv_caches)

    def replan_buckets(self, limits: BucketLimits) -> None:
        """Plan (and capture, on a GPU) the padded buckets again, for other limits: only between runs, with no step
        in flight (a benchmark that swaps in a wider speculation)."""
        if isinstance(self.backend, GraphBackend) and self.backend.enabled:
            b = self.backend
            self.backend = GraphBackend(b.eager, plan_buckets(limits), b.block_size, b.scratch_block, b.capture)
            self.backend.warm_up(self.kv_caches)
            self.bucket_limits = limits

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
