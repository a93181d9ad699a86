"""One packed, ragged forward of the target model per step, attention through the paged KV cache."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from smartspec.engine import attention, kernels
from smartspec.engine.block_manager import BlockManager
from smartspec.engine.fast_linear import pack_linears
from smartspec.engine.request import Request

logger = logging.getLogger(__name__)


def _kv_geometry(cfg) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a transformers config."""
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers, kv_heads, head_dim


@dataclass
class ForwardItem:
    """One request's part of a step: `tokens` at positions start.. (the cache grows by them), and logits wanted
    for the last `num_logits` of them."""
    request: Request
    tokens: list[int]
    start: int
    num_logits: int


class ModelRunner:
    def __init__(self, model: torch.nn.Module, blocks: BlockManager, use_kernels: bool, device: str) -> None:
        self.model = model
        self.blocks = blocks
        self.device = torch.device(device)
        self.num_layers, self.num_kv_heads, self.head_dim = _kv_geometry(model.config)
        self.dtype = next(model.parameters()).dtype
        ext = kernels.load() if use_kernels and self.device.type == "cpu" and self.dtype == torch.float32 else None
        self.use_kernels = ext is not None
        if self.use_kernels:
            pack_linears(model, ext)
        elif use_kernels:
            logger.warning("batch-invariant kernels not used (%s); running transformers' linears",
                           kernels.unavailable_reason() or f"{self.device.type}/{self.dtype}")
        model.config._attn_implementation = attention.ATTN_IMPLEMENTATION
        shape = (blocks.num_blocks, blocks.block_size, self.num_kv_heads, self.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device)) for _ in range(self.num_layers)]

    @staticmethod
    def bytes_per_block(model: torch.nn.Module, block_size: int) -> int:
        layers, kv_heads, head_dim = _kv_geometry(model.config)
        return 2 * layers * block_size * kv_heads * head_dim * next(model.parameters()).element_size()

    @torch.inference_mode()
    def forward(self, items: list[ForwardItem]) -> torch.Tensor:
        """Run all items in one forward; return logits [sum(num_logits), vocab] in item order (fp32)."""
        ids, positions, slots, seq_of, kv_len, keep = [], [], [], [], [], []
        offset = 0
        for row, item in enumerate(items):
            n = len(item.tokens)
            ids.extend(item.tokens)
            pos = range(item.start, item.start + n)
            positions.extend(pos)
            slots.extend(self.blocks.slot(item.request, p) for p in pos)
            seq_of.extend([row] * n)
            kv_len.extend(p + 1 for p in pos)
            keep.extend(range(offset + n - item.num_logits, offset + n))
            offset += n
        max_blocks = max(len(item.request.block_table) for item in items)
        tables = torch.zeros((len(items), max_blocks), dtype=torch.int32)
        for row, item in enumerate(items):
            tables[row, : len(item.request.block_table)] = torch.tensor(item.request.block_table, dtype=torch.int32)
        dev = self.device
        attention.set_step(attention.StepAttention(
            kv_caches=self.kv_caches,
            slots=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=tables.to(dev),
            seq_of=torch.tensor(seq_of, dtype=torch.int32, device=dev),
            kv_len=torch.tensor(kv_len, dtype=torch.int32, device=dev),
            use_kernels=self.use_kernels,
        ))
        try:
            out = self.model(
                input_ids=torch.tensor([ids], device=dev),
                position_ids=torch.tensor([positions], device=dev),
                use_cache=False,
                logits_to_keep=torch.tensor(keep, dtype=torch.long, device=dev),
            )
        finally:
            attention.set_step(None)
        return out.logits[0].float()
