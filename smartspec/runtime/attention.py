"""Paged attention plugged into transformers' attention interface, so models are used as written.

The model is called with use_cache=False; each attention layer hands this function its post-RoPE q/k/v for the
step's packed tokens, and it writes k/v into the paged cache and attends through it. What a step needs to know
(slots, block tables, per-token visible lengths, and the torch path's query groups) is set by the model runner in
`StepAttention` before the forward. The CPU kernels attend token by token in a fixed order (batch-invariant); the
torch path, for GPUs and machines without the kernels, attends each group of sequences in one masked call."""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from smartspec.runtime import kernels

ATTN_IMPLEMENTATION = "smartspec_paged"
logger = logging.getLogger(__name__)


NO_TREE = 2**31 - 1  # tree_base of a token outside any token tree: no cache position is masked
LONG_QUERY = 64  # a sequence with more query tokens than this (a prefill chunk) is attended in a call of its own


@dataclass
class QueryGroup:
    """Sequences attended in one padded call on the torch path: their tokens' queries laid out as `rows` rows of
    `width` slots, each row attending over the first `kv_width` positions of its sequence's cache. Built once per
    step on the host (group_queries), so no layer makes a host round trip."""
    token_index: torch.Tensor | None  # [n] int64: the group's tokens in the step's packed order; None: all, in order
    slot_index: torch.Tensor | None  # [n] int64: their slots in the padded [rows * width] queries; None: the same
    rows: int
    width: int
    kv_width: int
    block_tables: torch.Tensor  # [rows, max_blocks] int64
    kv_len: torch.Tensor  # [rows, width, 1] int64: a slot sees its sequence's positions [0, kv_len); padding: 1
    tree_base: torch.Tensor | None  # [rows, width, 1] int64 (NO_TREE outside trees); None: no trees
    tree_mask: torch.Tensor | None  # [rows, width, 1] int64

    def arrays(self) -> list[torch.Tensor | None]:
        """Its tensors, in the order with_arrays takes them (what a step uploads)."""
        return [self.token_index, self.slot_index, self.block_tables, self.kv_len, self.tree_base, self.tree_mask]

    def with_arrays(self, arrays: list[torch.Tensor | None]) -> QueryGroup:
        token_index, slot_index, block_tables, kv_len, tree_base, tree_mask = arrays
        return replace(self, token_index=token_index, slot_index=slot_index, block_tables=block_tables,
                       kv_len=kv_len, tree_base=tree_base, tree_mask=tree_mask)


@dataclass
class GroupLayout:
    """What every layer of a step reads for one query group, computed once per step (lay_out) rather than per
    layer: the cache slots each row attends, whole blocks at a time, and the boolean mask with each KV head's query
    heads folded into the query length (query head h = kv head * q_per_kv + j sits at j * width + column)."""
    group: QueryGroup
    kv_slots: torch.Tensor  # [rows, kv positions] int64: flat cache slots, kv positions = whole blocks >= kv_width
    mask: torch.Tensor  # [rows, 1, q_per_kv * width, kv positions] bool
    q_per_kv: int


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
    layouts: list[GroupLayout] | None = None  # the torch path's query groups, laid out (None on the kernels)


_local = threading.local()  # per thread: two engines stepping on two threads must not see each other's step


def set_step(step: StepAttention | None) -> None:
    _local.step = step


def group_queries(seq_of: torch.Tensor, kv_len: torch.Tensor, block_tables: torch.Tensor,
                  tree_base: torch.Tensor | None, tree_mask: torch.Tensor | None) -> list[QueryGroup]:
    """The step's sequences in query groups: every sequence of at most LONG_QUERY tokens (decodes, verify chains,
    token trees, short chunks) in one group, each longer prefill chunk in its own, so padding wastes at most the
    short rows' width. Inputs and groups are host tensors (a sequence's tokens are contiguous); the backend sends
    the groups to the device with the step's other inputs (runtime/upload.py)."""
    rows, counts = torch.unique_consecutive(seq_of, return_counts=True)
    ends = counts.cumsum(0).tolist()
    spans = [(row, end - n, end) for row, n, end in zip(rows.tolist(), counts.tolist(), ends)]  # (row, first, end)
    short = [s for s in spans if s[2] - s[1] <= LONG_QUERY]
    members = ([short] if short else []) + [[s] for s in spans if s[2] - s[1] > LONG_QUERY]
    return [_group(m, kv_len, block_tables, tree_base, tree_mask, whole=len(members) == 1) for m in members]


def _group(spans, kv_len, block_tables, tree_base, tree_mask, whole: bool) -> QueryGroup:
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

    def grid(x):
        return None if x is None else x.view(shape)

    in_order = whole and len(slot_index) == len(spans) * width  # the step's tokens fill the grid: no scatter
    return QueryGroup(None if in_order else torch.tensor(token_index),
                      None if in_order else torch.tensor(slot_index),
                      len(spans), width, int(lengths.max()),
                      block_tables[[row for row, _, _ in spans]].long(), grid(lengths), grid(base), grid(mask))


def lay_out(group: QueryGroup, block_size: int, q_per_kv: int, window: int = 0) -> GroupLayout:
    """The group's cache slots and folded mask (on the group's device, no host round trip). `window` > 0: a token
    sees only its last `window` positions (a sliding-window layer)."""
    blocks = -(-group.kv_width // block_size)
    tables = group.block_tables[:, :blocks]
    offsets = torch.arange(block_size, device=tables.device)
    kv_slots = (tables[:, :, None] * block_size + offsets).view(group.rows, blocks * block_size)
    pos = torch.arange(blocks * block_size, device=tables.device)
    seen = pos < group.kv_len  # [rows, width, kv positions]
    if window > 0:
        seen &= pos >= group.kv_len - window
    if group.tree_base is not None:
        bit = (group.tree_mask >> (pos - group.tree_base).clamp(0, 63)) & 1
        seen &= (pos < group.tree_base) | (bit == 1)
    mask = seen[:, None, None].expand(group.rows, 1, q_per_kv, group.width, pos.numel())
    return GroupLayout(group, kv_slots, mask.reshape(group.rows, 1, q_per_kv * group.width, pos.numel()), q_per_kv)


def q_per_kv(model_config) -> int:
    """Query heads that share one KV head (grouped-query attention; 1 without it)."""
    heads = model_config.num_attention_heads
    return heads // (getattr(model_config, "num_key_value_heads", None) or heads)


_kernels: dict[tuple, object] = {}  # CUDA: the SDPA kernel chosen for each kind of call, probed once


def attention_kernels() -> dict[str, str]:
    """The kernel each kind of attention call runs on (CUDA only): what a run reports."""
    return {f"{str(dtype).removeprefix('torch.')} kv_heads={heads} dim={dim}": backend.name
            for (dtype, heads, dim), backend in _kernels.items()}


def _sdpa(queries, keys, values, mask, scale: float) -> torch.Tensor:
    """Scaled-dot-product attention with the mask. On CUDA on a fused kernel that takes a mask (cuDNN, else
    memory-efficient: the faster two at decode shapes on an H200), chosen once per kind of call and logged, and
    chosen again for a shape the chosen one refuses; the math kernel (fp32 intermediates, a full score matrix) only
    where neither runs, with a warning."""
    if queries.device.type != "cuda":
        return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    key = (queries.dtype, queries.shape[1], queries.shape[-1])
    chosen = _kernels.get(key)
    if chosen is not None:
        try:
            with sdpa_kernel([chosen]):
                return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)
        except RuntimeError:  # refused before launching anything: this shape is chosen for again
            pass
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
        try:
            with sdpa_kernel([backend]):
                out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)
        except RuntimeError:
            continue
        if backend != chosen:
            _kernels[key] = backend
            log = logger.warning if backend == SDPBackend.MATH else logger.info
            log("paged attention (%s, %d kv heads, head dim %d, query length %d) runs on the %s kernel",
                queries.dtype, queries.shape[1], queries.shape[-1], queries.shape[2], backend.name)
        return out
    raise RuntimeError("no scaled-dot-product attention kernel runs this shape")


def _torch_paged_attention(q, k_cache, v_cache, layouts: list[GroupLayout], scale: float,
                           window: int) -> torch.Tensor:
    """The torch path (no compiled kernels, or a GPU): each query group in one masked scaled-dot-product call over
    its sequences' cached keys, gathered whole blocks at a time; no per-token work, no host round trip. A KV head's
    query heads share its keys as a longer query, so no kernel repeats K/V per query head (`enable_gqa`)."""
    T, H, D = q.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    out = None
    for lay in layouts:
        g, per = lay.group, lay.q_per_kv
        queries = q if g.token_index is None else q.new_zeros((g.rows * g.width, H, D)).index_copy_(
            0, g.slot_index, q[g.token_index])
        queries = queries.view(g.rows, g.width, kvh, per, D).permute(0, 2, 3, 1, 4).reshape(
            g.rows, kvh, per * g.width, D)
        keys = k_cache.view(-1, kvh, D)[lay.kv_slots].transpose(1, 2)  # [rows, kv heads, kv positions, D]
        values = v_cache.view(-1, kvh, D)[lay.kv_slots].transpose(1, 2)
        mask = lay.mask if window <= 0 else lay_out(g, bs, per, window).mask
        attended = _sdpa(queries, keys, values, mask, scale)  # [rows, kv heads, per * width, D]
        attended = attended.view(g.rows, kvh, per, g.width, D).permute(0, 3, 1, 2, 4).reshape(
            g.rows * g.width, H, D)
        if g.token_index is None:
            return attended  # the one group, every token in order
        if out is None:
            out = torch.empty_like(q)
        out[g.token_index] = attended[g.slot_index]
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
        out = _torch_paged_attention(q, k_cache, v_cache, step.layouts, scale, window)
    return out.unsqueeze(0), None  # [1, T, H, D], as transformers' own attention functions return


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
