"""Paged attention plugged into transformers' attention interface, so models are used as written.

The model is called with use_cache=False; each attention layer hands this function its post-RoPE q/k/v for the
step's packed tokens, and it writes k/v into the paged cache and attends through it. What a step needs to know
(slots, block tables, per-token visible lengths, and the torch path's query groups) is set by the model runner in
`StepAttention` before the forward. The CPU kernels attend token by token in a fixed order (batch-invariant); the
torch path, for GPUs and machines without the kernels, attends each group of sequences in one masked call."""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from smartspec.runtime import kernels

ATTN_IMPLEMENTATION = "smartspec_paged"


NO_TREE = 2**31 - 1  # tree_base of a token outside any token tree: no cache position is masked
LONG_QUERY = 64  # a sequence with more query tokens than this (a prefill chunk) is attended in a call of its own


@dataclass
class QueryGroup:
    """Sequences attended in one padded call on the torch path: their tokens' queries scattered into `rows` rows of
    `width` slots, each row attending over the first `kv_width` positions of its sequence's cache. Built once per
    step on the host (group_queries), so no layer makes a host round trip."""
    token_index: torch.Tensor  # [n] int64: the group's tokens in the step's packed order
    slot_index: torch.Tensor  # [n] int64: their slots in the padded [rows * width] queries
    rows: int
    width: int
    kv_width: int
    block_tables: torch.Tensor  # [rows, max_blocks] int64
    kv_len: torch.Tensor  # [rows, width, 1] int64: a slot sees its sequence's positions [0, kv_len); padding: 1
    tree_base: torch.Tensor | None  # [rows, width, 1] int64 (NO_TREE outside trees); None: no trees
    tree_mask: torch.Tensor | None  # [rows, width, 1] int64


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
    groups: list[QueryGroup] | None = None  # the torch path's query groups (None on the kernels)


_local = threading.local()  # per thread: two engines stepping on two threads must not see each other's step


def set_step(step: StepAttention | None) -> None:
    _local.step = step


def group_queries(seq_of: torch.Tensor, kv_len: torch.Tensor, block_tables: torch.Tensor,
                  tree_base: torch.Tensor | None, tree_mask: torch.Tensor | None, device) -> list[QueryGroup]:
    """The step's sequences in query groups: every sequence of at most LONG_QUERY tokens (decodes, verify chains,
    token trees, short chunks) in one group, each longer prefill chunk in its own, so padding wastes at most the
    short rows' width. Inputs are the step's host tensors (a sequence's tokens are contiguous)."""
    rows, counts = torch.unique_consecutive(seq_of, return_counts=True)
    ends = counts.cumsum(0).tolist()
    spans = [(row, end - n, end) for row, n, end in zip(rows.tolist(), counts.tolist(), ends)]  # (row, first, end)
    short = [s for s in spans if s[2] - s[1] <= LONG_QUERY]
    members = ([short] if short else []) + [[s] for s in spans if s[2] - s[1] > LONG_QUERY]
    return [_group(m, kv_len, block_tables, tree_base, tree_mask, device) for m in members]


def _group(spans, kv_len, block_tables, tree_base, tree_mask, device) -> QueryGroup:
    width = max(end - start for _, start, end in spans)
    token_index = [t for _, start, end in spans for t in range(start, end)]
    slot_index = [i * width + j for i, (_, start, end) in enumerate(spans) for j in range(end - start)]
    lengths = torch.ones(len(spans) * width, dtype=torch.int64)
    lengths[slot_index] = kv_len[token_index].to(torch.int64)
    base = mask = None
    if tree_base is not None:
        base = torch.full((len(spans) * width,), NO_TREE, dtype=torch.int64)
        base[slot_index] = tree_base[token_index].to(torch.int64)
        mask = torch.zeros(len(spans) * width, dtype=torch.int64)
        mask[slot_index] = tree_mask[token_index]
    shape = (len(spans), width, 1)

    def dev(x):
        return None if x is None else x.view(shape).to(device)

    return QueryGroup(torch.tensor(token_index, device=device), torch.tensor(slot_index, device=device),
                      len(spans), width, int(lengths.max()),
                      block_tables[[row for row, _, _ in spans]].to(device=device, dtype=torch.int64),
                      dev(lengths), dev(base), dev(mask))


def _torch_paged_attention(q, k_cache, v_cache, groups: list[QueryGroup], scale: float, window: int) -> torch.Tensor:
    """The torch path (no compiled kernels, or a GPU): each query group in one masked scaled-dot-product call over
    its sequences' cached keys, gathered through the block tables; no per-token work, no host round trip."""
    T, H, D = q.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    for g in groups:
        queries = q.new_zeros((g.rows * g.width, H, D))
        queries[g.slot_index] = q[g.token_index]
        pos = torch.arange(g.kv_width, device=q.device)
        blocks = g.block_tables[:, pos // bs]  # [rows, kv_width]
        keys = k_cache[blocks, pos % bs].transpose(1, 2)  # [rows, kv heads, kv_width, D]
        values = v_cache[blocks, pos % bs].transpose(1, 2)
        seen = pos < g.kv_len  # [rows, width, kv_width]
        if window > 0:
            seen &= pos >= g.kv_len - window
        if g.tree_base is not None:
            bit = (g.tree_mask >> (pos - g.tree_base).clamp(0, 63)) & 1
            seen &= (pos < g.tree_base) | (bit == 1)
        attended = F.scaled_dot_product_attention(
            queries.view(g.rows, g.width, H, D).transpose(1, 2), keys, values, attn_mask=seen[:, None],
            scale=scale, enable_gqa=H != kvh)  # [rows, H, width, D]
        out[g.token_index] = attended.transpose(1, 2).reshape(g.rows * g.width, H, D)[g.slot_index]
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
        out = _torch_paged_attention(q, k_cache, v_cache, step.groups, scale, window)
    return out.unsqueeze(0), None  # [1, T, H, D], as transformers' own attention functions return


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
