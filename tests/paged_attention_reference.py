"""Paged attention token by token, as the definition reads: each token gathers the keys it sees (its sequence's
positions before kv_len, inside the window, and in a token tree only its ancestors) and attends over them in fp32.
What the torch path (smartspec/runtime/attention.py) is held to."""
import torch


def reference_paged_attention(q, k_cache, v_cache, block_tables, seq_of, kv_len, scale, window=0, tree_base=None,
                              tree_mask=None):
    T, H, D = q.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    for t in range(T):
        n = int(kv_len[t])
        pos = torch.arange(max(0, n - window) if window > 0 else 0, n)
        if tree_base is not None:
            base = int(tree_base[t])
            bit = (tree_mask[t] >> (pos - base).clamp(0, 63)) & 1
            pos = pos[(pos < base) | (bit == 1)]
        blocks = block_tables[int(seq_of[t])].to(torch.int64)[pos // bs]
        k = k_cache[blocks, pos % bs].repeat_interleave(H // kvh, dim=1)  # [L, H, D]
        v = v_cache[blocks, pos % bs].repeat_interleave(H // kvh, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[t].float(), k.float()) * scale
        out[t] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v.float()).to(q.dtype)
    return out
