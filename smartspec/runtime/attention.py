"""Paged attention plugged into transformers' attention interface, so models are used as written.

The model is called with use_cache=False; each attention layer hands this function its post-RoPE q/k/v for the
step's packed tokens, and it writes k/v into the paged cache and attends through it. What a step needs to know
(slots, block tables, per-token visible lengths) is set by the model runner in `StepAttention` before the forward.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from smartspec.runtime import kernels

ATTN_IMPLEMENTATION = "smartspec_paged"


@dataclass
class StepAttention:
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: [num_blocks, block_size, kv_heads, head_dim]
    slots: torch.Tensor  # [T] int64: cache slot for each token's k/v
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_of: torch.Tensor  # [T] int32: row of block_tables each token belongs to
    kv_len: torch.Tensor  # [T] int32: a token sees its sequence's positions [0, kv_len)
    use_kernels: bool
    # a token t at or past tree_base[t] in the cache sees it only where bit (position - tree_base[t]) of
    # tree_mask[t] is set: a token-tree node sees its ancestors, not its siblings. None: no trees in the step
    tree_base: torch.Tensor | None = None  # [T] int32
    tree_mask: torch.Tensor | None = None  # [T] int64


_local = threading.local()  # per thread: two engines stepping on two threads must not see each other's step


def set_step(step: StepAttention | None) -> None:
    _local.step = step


def _torch_paged_attention(q, k_cache, v_cache, step: StepAttention, scale: float, window: int) -> torch.Tensor:
    """The reference path (no compiled kernels, or a GPU): gather each token's visible keys and attend."""
    T, H, D = q.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    for t in range(T):
        n = int(step.kv_len[t])
        start = max(0, n - window) if window > 0 else 0
        pos = torch.arange(start, n, device=q.device)
        if step.tree_base is not None:
            base = int(step.tree_base[t])
            bit = (step.tree_mask[t] >> (pos - base).clamp(0, 63)) & 1
            pos = pos[(pos < base) | (bit == 1)]
        blocks = step.block_tables[int(step.seq_of[t])].to(torch.int64)[pos // bs]
        k = k_cache[blocks, pos % bs].repeat_interleave(H // kvh, dim=1)  # [L, H, D]
        v = v_cache[blocks, pos % bs].repeat_interleave(H // kvh, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[t].float(), k.float()) * scale
        out[t] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v.float()).to(q.dtype)
    return out


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    step = getattr(_local, "step", None)
    if step is None:
        raise RuntimeError("smartspec paged attention called outside an engine step")
    k_cache, v_cache = step.kv_caches[module.layer_idx]
    q = query[0].transpose(0, 1)  # [T, H, D]
    kvh, d = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, kvh, d).index_copy_(0, step.slots, key[0].transpose(0, 1))
    v_cache.view(-1, kvh, d).index_copy_(0, step.slots, value[0].transpose(0, 1))
    scale = scaling if scaling is not None else d ** -0.5
    window = kwargs.get("sliding_window") or 0
    ext = kernels.load() if step.use_kernels else None
    if ext is not None:
        out = ext.paged_attention(q, k_cache, v_cache, step.block_tables, step.seq_of, step.kv_len, scale, window,
                                  step.tree_base, step.tree_mask)
    else:
        out = _torch_paged_attention(q, k_cache, v_cache, step, scale, window)
    return out.unsqueeze(0), None  # [1, T, H, D], as transformers' own attention functions return


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
