"""The torch attention path (GPUs, and machines without the CPU kernels): sequences attended in padded groups, one
masked scaled-dot-product call each, held to the token-by-token definition on random caches: prefill chunks short
and long, decodes, draft chains, token trees, grouped-query heads, sliding windows."""
import pytest
import torch
from paged_attention_reference import reference_paged_attention

from smartspec.runtime import attention
from smartspec.runtime.attention import LONG_QUERY, group_queries
from smartspec.runtime.block_manager import BlockManager
from smartspec.runtime.model_runner import ForwardItem, prepare_step
from smartspec.types.request import Request
from smartspec.types.sampling_params import SamplingParams
from smartspec.types.tree import TokenTree

BLOCK = 4


def a_step(with_tree: bool):
    """A step of every kind of item over random contexts: (items, block manager)."""
    blocks = BlockManager(128, BLOCK)
    items = []

    def request(rid, context, fed, **kw):
        r = Request(rid, list(range(context + fed)), SamplingParams())
        blocks.allocate(r, context + fed)
        r.num_computed_tokens = context
        return r

    long_prefill = request("long", 0, LONG_QUERY + 9)  # a chunk in a group of its own
    items.append(ForwardItem(long_prefill, long_prefill.token_ids, 0, 1))
    chunk = request("chunk", 13, 20)  # a later chunk of a prompt, after cached positions
    items.append(ForwardItem(chunk, chunk.token_ids[13:], 13, 1))
    for i, context in enumerate((1, 7, 30)):  # decodes
        r = request(f"d{i}", context, 1)
        items.append(ForwardItem(r, r.token_ids[context:], context, 1))
    chain = request("chain", 21, 6)  # the last token and five drafts
    items.append(ForwardItem(chain, chain.token_ids[21:], 21, 6))
    if with_tree:
        tree = TokenTree([5, 6, 7, 8, 9], [-1, -1, 0, 0, 2], [0.5] * 5)
        r = request("tree", 17, 1 + len(tree))
        c = 17
        items.append(ForwardItem(r, [r.token_ids[c]] + tree.tokens, c, 1 + len(tree),
                                 positions=[c] + [c + d for d in tree.depths()], tree_base=c,
                                 tree_masks=tree.ancestor_masks()))
    return items, blocks


@pytest.mark.parametrize("with_tree", [False, True])
@pytest.mark.parametrize("heads, kv_heads, window", [(4, 4, 0), (6, 2, 0), (4, 2, 9)])
def test_the_torch_path_is_the_definition(with_tree, heads, kv_heads, window):
    torch.manual_seed(0)
    items, blocks = a_step(with_tree)
    x = prepare_step(items, blocks)
    d = 16
    k_cache = torch.randn(blocks.num_blocks, BLOCK, kv_heads, d)
    v_cache = torch.randn(blocks.num_blocks, BLOCK, kv_heads, d)
    q = torch.randn(len(x.ids), heads, d)
    groups = group_queries(x.seq_of, x.kv_len, x.block_tables, x.tree_base, x.tree_mask)
    assert len(groups) == 2 and groups[1].rows == 1  # the short sequences together, the long chunk alone
    layouts = [attention.lay_out(g, BLOCK, heads // kv_heads) for g in groups]
    got = attention._torch_paged_attention(q, k_cache, v_cache, layouts, d ** -0.5, window)
    want = reference_paged_attention(q, k_cache, v_cache, x.block_tables, x.seq_of, x.kv_len, d ** -0.5, window,
                                     x.tree_base, x.tree_mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_tree_node_does_not_see_its_siblings():
    """Changing a sibling's cached key changes nothing for a node; changing its parent's does."""
    torch.manual_seed(1)
    items, blocks = a_step(with_tree=True)
    x = prepare_step(items, blocks)
    k_cache, v_cache = torch.randn(blocks.num_blocks, BLOCK, 2, 8), torch.randn(blocks.num_blocks, BLOCK, 2, 8)
    q = torch.randn(len(x.ids), 2, 8)
    groups = group_queries(x.seq_of, x.kv_len, x.block_tables, x.tree_base, x.tree_mask)
    layouts = [attention.lay_out(g, BLOCK, 1) for g in groups]
    before = attention._torch_paged_attention(q, k_cache, v_cache, layouts, 0.3, 0)
    tree_item = items[-1]
    node2 = len(x.ids) - 5 + 2  # node 2 (child of node 0) in the packed tokens: root, nodes 0-4
    sibling, parent = tree_item.start + 1 + 1, tree_item.start + 1 + 0  # nodes 1 and 0, as stored
    for position, changes in ((sibling, False), (parent, True)):
        k = k_cache.clone()
        slot = blocks.slot(tree_item.request, position)
        k.view(-1, 2, 8)[slot] += 5.0
        after = attention._torch_paged_attention(q, k, v_cache, layouts, 0.3, 0)
        assert (not torch.equal(after[node2], before[node2])) == changes


def long_step(blocks: BlockManager, context: int):
    """A decode, a verify chain, a token tree and a prefill chunk, each over `context` cached positions."""
    def request(rid, fed):
        r = Request(rid, list(range(context + fed)), SamplingParams())
        blocks.allocate(r, context + fed)
        return r

    decode, chain, chunk, tree_req = request("d", 1), request("c", 5), request("p", 40), request("t", 6)
    tree = TokenTree([5, 6, 7, 8, 9], [-1, -1, 0, 0, 2], [0.5] * 5)
    c = context
    return [ForwardItem(decode, decode.token_ids[c:], c, 1), ForwardItem(chain, chain.token_ids[c:], c, 5),
            ForwardItem(chunk, chunk.token_ids[c:], c, 1),
            ForwardItem(tree_req, [tree_req.token_ids[c]] + tree.tokens, c, 6,
                        positions=[c] + [c + d for d in tree.depths()], tree_base=c,
                        tree_masks=tree.ancestor_masks())]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("context", [0, 1, 63, 1000, 4095])
def test_every_step_kind_mixed_at_long_contexts(context, dtype, tol):
    """The four step kinds in one batch at contexts up to 4096, grouped-query heads, in the run's dtype against the
    fp32 definition; the lone in-order group (no scatter) too."""
    torch.manual_seed(context)
    blocks = BlockManager(4 * (4096 // 16 + 2), 16)
    items = long_step(blocks, context)
    x = prepare_step(items, blocks)
    heads, kv_heads, d = 6, 2, 16
    k_cache = torch.randn(blocks.num_blocks, 16, kv_heads, d)
    v_cache = torch.randn(blocks.num_blocks, 16, kv_heads, d)
    q = torch.randn(len(x.ids), heads, d)
    want = reference_paged_attention(q, k_cache, v_cache, x.block_tables, x.seq_of, x.kv_len, d ** -0.5, 0,
                                     x.tree_base, x.tree_mask)
    groups = group_queries(x.seq_of, x.kv_len, x.block_tables, x.tree_base, x.tree_mask)
    layouts = [attention.lay_out(g, 16, heads // kv_heads) for g in groups]
    got = attention._torch_paged_attention(q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), layouts, d ** -0.5, 0)
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    decodes = [items[0], ForwardItem(items[1].request, items[1].tokens[:1], context, 1)]
    y = prepare_step(decodes, blocks)
    (alone,) = group_queries(y.seq_of, y.kv_len, y.block_tables, None, None)
    assert alone.token_index is None  # every row one token wide: the grid is the step itself
    got = attention._torch_paged_attention(q[:2], k_cache, v_cache, [attention.lay_out(alone, 16, 3)], d ** -0.5, 0)
    torch.testing.assert_close(got, reference_paged_attention(q[:2], k_cache, v_cache, y.block_tables, y.seq_of,
                                                              y.kv_len, d ** -0.5, 0, None, None),
                               rtol=1e-5, atol=1e-5)
