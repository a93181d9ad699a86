import pytest
import torch
import torch.nn.functional as F

from smartspec.runtime import kernels

ext = kernels.load()
pytestmark = pytest.mark.skipif(ext is None, reason=f"kernels unavailable: {kernels.unavailable_reason()}")


# k = 4100: more rows than one block cut k into blocks of 2048 (and a 4-long tail), a few rows do not
@pytest.mark.parametrize("n,k", [(96, 64), (100, 72), (8960 // 16, 1536 // 16), (33, 8), (40, 4100)])
def test_linear_matches_torch_and_is_batch_invariant(n, k):
    torch.manual_seed(0)
    w, b, x = torch.randn(n, k), torch.randn(n), torch.randn(37, k)
    packed = ext.pack_weight(w)
    y = ext.linear(x, packed, n, b)
    # against float64: one fp32 chain over k rounds more as k grows (BLAS sums in blocks)
    ref = F.linear(x.double(), w.double(), b.double())
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * max(1, k / 64))
    # each row alone, and inside every batch size, gives the very same bits
    for m in (1, 2, 3, 5, 8, 9, 16, 37):
        ym = ext.linear(x[:m], packed, n, b)
        assert torch.equal(ym, y[:m]), m
        assert torch.equal(ext.linear(x[m - 1:m], packed, n, b), y[m - 1:m]), m
    # work is handed to threads as they free up: how many there are changes no bit
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(ext.linear(x, packed, n, b), y)
    finally:
        torch.set_num_threads(threads)


def test_linear_is_not_trivially_equal_to_a_constant():
    # guards the invariance test above from passing on a kernel that ignores its input
    w = torch.randn(32, 16)
    p = ext.pack_weight(w)
    assert not torch.equal(ext.linear(torch.randn(2, 16), p, 32, None), ext.linear(torch.randn(2, 16), p, 32, None))


def _reference_attention(q, k_cache, v_cache, table, kv_len, scale, window=0):
    bs = k_cache.shape[1]
    out = []
    for t in range(q.shape[0]):
        n = kv_len[t]
        start = max(0, n - window) if window else 0
        pos = torch.arange(start, n)
        blocks = torch.tensor(table)[pos // bs]
        k = k_cache[blocks, pos % bs].repeat_interleave(q.shape[1] // k_cache.shape[2], 1)
        v = v_cache[blocks, pos % bs].repeat_interleave(q.shape[1] // k_cache.shape[2], 1)
        p = (torch.einsum("hd,lhd->hl", q[t], k) * scale).softmax(-1)
        out.append(torch.einsum("hl,lhd->hd", p, v))
    return torch.stack(out)


@pytest.mark.parametrize("window", [0, 5])
def test_paged_attention_matches_reference(window):
    torch.manual_seed(0)
    num_blocks, bs, kvh, d, h = 12, 4, 2, 16, 4
    kc, vc = torch.randn(num_blocks, bs, kvh, d), torch.randn(num_blocks, bs, kvh, d)
    tables = torch.tensor([[3, 7, 1, 0], [5, 2, 9, 11]], dtype=torch.int32)
    # sequence 0: 3 query tokens at positions 8..10; sequence 1: one token at position 13
    seq_of = torch.tensor([0, 0, 0, 1], dtype=torch.int32)
    kv_len = torch.tensor([9, 10, 11, 14], dtype=torch.int32)
    q = torch.randn(4, h, d)
    out = ext.paged_attention(q, kc, vc, tables, seq_of, kv_len, 0.25, window, None, None)
    for t in range(4):
        ref = _reference_attention(q[t:t + 1], kc, vc, tables[seq_of[t]].tolist(), [int(kv_len[t])], 0.25, window)
        torch.testing.assert_close(out[t:t + 1], ref, rtol=1e-5, atol=1e-5)
        alone = ext.paged_attention(q[t:t + 1], kc, vc, tables, seq_of[t:t + 1], kv_len[t:t + 1], 0.25, window,
                                    None, None)
        assert torch.equal(alone, out[t:t + 1])


# head shapes: a group of 6 heads per KV head (the 1.5B), 16 (more than one unit's 8), head dims with tails
@pytest.mark.parametrize("h,kvh,d", [(12, 2, 128), (4, 2, 16), (9, 3, 64), (16, 1, 80), (2, 1, 20)])
def test_a_tree_node_sees_the_bits_a_plain_token_sees(h, kvh, d):
    """A node that skips its siblings gets the bits of the same query over its visible keys laid out in a row:
    work runs over the list of keys a query sees, so a hidden position in between shifts no lane."""
    torch.manual_seed(0)
    bs, prefix = 4, 37
    kc, vc = torch.randn(16, bs, kvh, d), torch.randn(16, bs, kvh, d)
    table = torch.randperm(16).to(torch.int32)[None]
    nodes = [0, 2, 5, 7]  # of 8 tree nodes at positions 37..44, the query (node 7) sees nodes 0, 2, 5 and itself
    mask = torch.tensor([sum(1 << i for i in nodes)])
    q = torch.randn(1, h, d)
    seq0 = torch.tensor([0], dtype=torch.int32)
    node = ext.paged_attention(q, kc, vc, table, seq0, torch.tensor([prefix + 8], dtype=torch.int32), 0.3, 0,
                               torch.tensor([prefix], dtype=torch.int32), mask)
    seen = list(range(prefix)) + [prefix + i for i in nodes]
    blocks, rows = table[0, torch.tensor(seen) // bs].long(), torch.tensor(seen) % bs
    row_k, row_v = torch.zeros(16, bs, kvh, d), torch.zeros(16, bs, kvh, d)
    row_k.view(-1, kvh, d)[:len(seen)], row_v.view(-1, kvh, d)[:len(seen)] = kc[blocks, rows], vc[blocks, rows]
    plain = ext.paged_attention(q, row_k, row_v, torch.arange(16, dtype=torch.int32)[None], seq0,
                                torch.tensor([len(seen)], dtype=torch.int32), 0.3, 0, None, None)
    assert torch.equal(node, plain)
    ref = _reference_attention(q, row_k, row_v, list(range(16)), [len(seen)], 0.3)
    torch.testing.assert_close(plain, ref, rtol=1e-5, atol=1e-5)
    # heads are shared out among threads in groups of a size that hangs on the thread count: no bit moves
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(ext.paged_attention(q, row_k, row_v, torch.arange(16, dtype=torch.int32)[None], seq0,
                                               torch.tensor([len(seen)], dtype=torch.int32), 0.3, 0, None, None),
                           plain)
    finally:
        torch.set_num_threads(threads)


def test_tree_mask_hides_siblings():
    torch.manual_seed(0)
    kc, vc = torch.randn(4, 4, 1, 8), torch.randn(4, 4, 1, 8)
    table = torch.tensor([[0, 1, 2, 3]], dtype=torch.int32)
    q = torch.randn(1, 1, 8)
    seq0, n = torch.tensor([0], dtype=torch.int32), torch.tensor([7], dtype=torch.int32)
    base = torch.tensor([4], dtype=torch.int32)
    # tree nodes at positions 4, 5, 6; the query (node 6) sees node 4 (its parent) and itself, not node 5
    masked = ext.paged_attention(q, kc, vc, table, seq0, n, 1.0, 0, base, torch.tensor([0b101]))
    ref = _reference_attention(q, kc[:, :, :, :], vc, [0, 1, 2, 3], [7], 1.0)
    assert not torch.allclose(masked, ref)
    kc2, vc2 = kc.clone(), vc.clone()
    kc2[1, 1], vc2[1, 1] = 100.0, 100.0  # change the sibling (position 5): the result must not move
    again = ext.paged_attention(q, kc2, vc2, table, seq0, n, 1.0, 0, base, torch.tensor([0b101]))
    assert torch.equal(masked, again)
