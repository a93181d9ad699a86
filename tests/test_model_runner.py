"""The model runner: a step's items packed into one ragged forward through the paged cache. A row of logits is the
same bits however the step around it is packed (prefill in chunks or whole, alone or beside other requests, a
draft chain or a token tree), which is what makes speculation lossless bitwise on the CPU kernels."""
import pytest
import torch
from transformers import AutoModelForCausalLM
from transfers import Transfers

from smartspec.models import load_model
from smartspec.runtime import fused_decoder, kernels
from smartspec.runtime.backends import FusedKernelBackend, ModulesBackend
from smartspec.runtime.block_manager import BlockManager
from smartspec.runtime.model_runner import NO_TREE, ForwardItem, ModelRunner, prepare_step
from smartspec.types.request import Request
from smartspec.types.sampling_params import SamplingParams
from smartspec.types.tree import TokenTree

needs_kernels = pytest.mark.skipif(kernels.load() is None,
                                   reason=f"kernels unavailable: {kernels.unavailable_reason()}")
TOKENS = [5, 17, 99, 3, 42, 8, 61, 7, 23, 11]


def runner_for(path, use_kernels=True, num_blocks=32):
    loaded = load_model(path, quantization="auto")  # a folder with a GGUF file keeps its GGUF blocks
    return ModelRunner(loaded.model, BlockManager(num_blocks, 4), use_kernels, "cpu")


def request(rid, tokens, blocks, n=None):
    r = Request(rid, list(tokens), SamplingParams())
    blocks.allocate(r, n or len(tokens))
    return r


def test_prepare_step_packs_ragged_items_with_their_slots_and_rows():
    blocks = BlockManager(16, 4)
    a = request("a", range(6), blocks)
    b = request("b", range(3), blocks, n=5)
    b.num_computed_tokens = 2
    items = [ForwardItem(a, list(range(6)), 0, 1),  # a prefill: only its last row's logits
             ForwardItem(b, [2, 40, 41], 2, 3)]  # a decode of b's last token and two drafts: every row
    x = prepare_step(items, blocks)
    assert x.ids.tolist() == [0, 1, 2, 3, 4, 5, 2, 40, 41]
    assert x.positions.tolist() == [0, 1, 2, 3, 4, 5, 2, 3, 4]
    assert x.slots.tolist() == [blocks.slot(a, p) for p in range(6)] + [blocks.slot(b, p) for p in (2, 3, 4)]
    assert x.seq_of.tolist() == [0] * 6 + [1] * 3 and x.kv_len.tolist() == [1, 2, 3, 4, 5, 6, 3, 4, 5]
    assert x.keep.tolist() == [5, 6, 7, 8]
    assert x.block_tables.shape == (2, 2) and x.tree_base is None


def packed_token_by_token(items, blocks):
    """prepare_step's inputs spelled out token by token: what its array operations must equal."""
    ids, positions, slots, seq_of, kv_len, keep, bases, masks, offset = [], [], [], [], [], [], [], [], 0
    for row, item in enumerate(items):
        n = len(item.tokens)
        for j in range(n):
            p = item.start + j
            ids.append(item.tokens[j])
            positions.append(item.positions[j] if item.positions is not None else p)
            slots.append(blocks.slot(item.request, p))
            seq_of.append(row)
            kv_len.append(p + 1)
            if j >= n - item.num_logits:
                keep.append(offset + j)
            bases.append(NO_TREE if item.tree_masks is None else item.tree_base)
            masks.append(0 if item.tree_masks is None else item.tree_masks[j])
        offset += n
    return ids, positions, slots, seq_of, kv_len, keep, bases, masks


def test_prepare_step_equals_its_inputs_spelled_out_token_by_token():
    import random

    rng = random.Random(0)
    for trial in range(30):
        blocks = BlockManager(256, 4)
        items = []
        for i in range(rng.randint(1, 6)):
            start, n = rng.randint(0, 20), rng.randint(1, 9)
            r = request(f"r{i}", range(start + 1), blocks, n=start + n)
            kind = rng.choice(["chain", "prefill", "tree"]) if trial % 3 else "chain"
            if kind == "tree":
                masks = [1] + [rng.getrandbits(n) | 1 for _ in range(n - 1)]
                items.append(ForwardItem(r, [rng.randrange(99) for _ in range(n)], start, n,
                                         positions=[start + rng.randint(0, j) for j in range(n)], tree_base=start,
                                         tree_masks=masks))
            else:
                items.append(ForwardItem(r, [rng.randrange(99) for _ in range(n)], start,
                                         rng.choice([0, 1, n]) if kind == "prefill" else n))
        x = prepare_step(items, blocks)
        ids, positions, slots, seq_of, kv_len, keep, bases, masks = packed_token_by_token(items, blocks)
        assert (x.ids.tolist(), x.positions.tolist(), x.slots.tolist(), x.seq_of.tolist(), x.kv_len.tolist(),
                x.keep.tolist()) == (ids, positions, slots, seq_of, kv_len, keep)
        assert (x.ids.dtype, x.positions.dtype, x.slots.dtype, x.seq_of.dtype, x.kv_len.dtype, x.keep.dtype,
                x.block_tables.dtype) == (torch.int64,) * 3 + (torch.int32,) * 2 + (torch.int64, torch.int32)
        for row, item in enumerate(items):
            width = len(item.request.block_table)
            assert x.block_tables[row, :width].tolist() == item.request.block_table
            assert not x.block_tables[row, width:].any()
        trees = any(item.tree_masks is not None for item in items)
        assert (x.tree_base is not None) == trees
        if trees:
            assert x.tree_base.tolist() == bases and x.tree_mask.tolist() == masks
            assert (x.tree_base.dtype, x.tree_mask.dtype) == (torch.int32, torch.int64)
    blocks = BlockManager(8, 4)
    short = request("short", range(3), blocks)  # one block: positions 0-3
    with pytest.raises(IndexError):  # a token past the request's blocks
        prepare_step([ForwardItem(short, [1, 2], 3, 1)], blocks)


def test_prepare_step_places_tree_nodes_at_their_depth():
    blocks = BlockManager(16, 4)
    r = request("r", range(4), blocks, n=8)
    r.num_computed_tokens = 3
    tree = TokenTree([10, 11, 12], [-1, -1, 0], [0.5, 0.4, 0.3])  # two children of the root; one grandchild
    item = ForwardItem(r, [3] + tree.tokens, 3, 4, positions=[3] + [3 + d for d in tree.depths()], tree_base=3,
                       tree_masks=tree.ancestor_masks())
    other = request("o", range(2), blocks)
    x = prepare_step([item, ForwardItem(other, [0, 1], 0, 1)], blocks)
    assert x.positions.tolist() == [3, 4, 4, 5, 0, 1]
    assert x.tree_base.tolist() == [3, 3, 3, 3, NO_TREE, NO_TREE]
    # each node sees the root (bit 0) and its ancestors, not its siblings
    assert x.tree_mask.tolist()[:4] == [0b1, 0b11, 0b101, 0b1011]


@needs_kernels
def test_kernels_are_chosen_where_they_run(tiny_qwen, tiny_gguf):
    gguf = runner_for(tiny_gguf)
    # a Qwen2 on GGUF weights runs fused where its linears take int8 activations (AVX-512 VNNI), else the modules
    assert isinstance(gguf.backend, FusedKernelBackend) == (fused_decoder.unsupported(gguf.model) is None)
    modules = runner_for(tiny_qwen).backend  # fp32 weights: transformers' modules on the kernels
    assert isinstance(modules, ModulesBackend) and modules.uses_kernels
    assert not runner_for(tiny_qwen, use_kernels=False).use_kernels


@needs_kernels
@pytest.mark.parametrize("fixture", ["tiny_qwen", "tiny_gguf"])
def test_a_rows_logits_do_not_depend_on_how_the_step_is_packed(fixture, request):
    runner = runner_for(request.getfixturevalue(fixture))
    whole = runner.score(TOKENS)  # one prefill, every row
    # the same tokens as a prefill chunk, then a chain of "drafts", beside another request's prefill
    blocks = runner.blocks
    r = request_in(blocks, "r", TOKENS)
    other = request_in(blocks, "other", [1, 2, 3, 4, 5])
    first = runner.forward([ForwardItem(r, TOKENS[:6], 0, 6), ForwardItem(other, [1, 2, 3, 4, 5], 0, 1)])
    rest = runner.forward([ForwardItem(other, [6], 5, 1), ForwardItem(r, TOKENS[6:], 6, 4)])
    assert torch.equal(first[:6], whole[:6]) and torch.equal(rest[1:], whole[6:])
    blocks.free(r)
    blocks.free(other)


def request_in(blocks, rid, tokens):
    r = Request(rid, list(tokens), SamplingParams())
    blocks.allocate(r, len(tokens) + 1)
    return r


def test_the_reference_path_matches_transformers(tiny_qwen):
    """Without the kernels, attention runs on torch's reference path: the logits are transformers' own, to
    floating-point reordering (different summation orders, no other difference)."""
    runner = runner_for(tiny_qwen, use_kernels=False)
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([TOKENS])).logits[0]
    got = runner.score(TOKENS)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_copy_kv_moves_entries_in_every_layer(tiny_qwen):
    runner = runner_for(tiny_qwen, use_kernels=False)
    r = request_in(runner.blocks, "r", TOKENS)
    runner.forward([ForwardItem(r, TOKENS, 0, 1)])
    src, dst = [runner.blocks.slot(r, p) for p in (7, 8)], [runner.blocks.slot(r, p) for p in (5, 6)]
    before = [(k.view(-1, *k.shape[2:])[src].clone(), v.view(-1, *v.shape[2:])[src].clone())
              for k, v in runner.kv_caches]
    runner.copy_kv(src, dst)
    for (k, v), (k_src, v_src) in zip(runner.kv_caches, before):
        assert torch.equal(k.view(-1, *k.shape[2:])[dst], k_src) and torch.equal(v.view(-1, *v.shape[2:])[dst], v_src)


def test_score_holds_cache_blocks_only_for_the_call(tiny_qwen):
    runner = runner_for(tiny_qwen, use_kernels=False)
    assert runner.score(TOKENS).shape == (len(TOKENS), load_model(tiny_qwen, weights=False).config.vocab_size)
    assert runner.blocks.num_free == runner.blocks.num_blocks


@pytest.mark.parametrize("padded", [False, True])
def test_a_forward_sends_its_inputs_to_the_device_in_one_copy(tiny_qwen, padded, monkeypatch):
    """The torch path (a GPU's) and its padded steps: a step of a prefill, decodes, a draft chain and a token tree
    crosses to the device once, however many arrays it reads (on a GPU: one non-blocking copy from pinned memory,
    runtime/upload.py)."""
    from smartspec.runtime.graph_buckets import BucketLimits
    loaded = load_model(tiny_qwen, quantization=None)
    limits = BucketLimits(max_rows=8, max_width=8, max_kv=64, block_size=4, trees=True)
    runner = ModelRunner(loaded.model, BlockManager(64, 4), False, "cpu", step_graphs="padded" if padded else "off",
                         bucket_limits=limits if padded else None)
    blocks = runner.blocks
    done = [request(f"r{i}", TOKENS, blocks, n=len(TOKENS) + 6) for i in range(3)]
    runner.forward([ForwardItem(r, TOKENS, 0, 1) for r in done])
    tree = TokenTree([50, 51, 52], [-1, -1, 0], [0.5] * 3)
    n = len(TOKENS)
    decodes = [ForwardItem(done[0], [7], n, 1), ForwardItem(done[1], [7, 40, 41, 42], n, 4),
               ForwardItem(done[2], [7, *tree.tokens], n, 4, positions=[n] + [n + d for d in tree.depths()],
                           tree_base=n, tree_masks=tree.ancestor_masks())]
    prefill = request("p", TOKENS, blocks)
    for step in (decodes, [ForwardItem(prefill, TOKENS, 0, 1)]):
        transfers = Transfers(monkeypatch)
        runner.forward(step)
        monkeypatch.undo()
        in_bucket = padded and step is decodes  # a prefill wider than a verify row runs eagerly
        assert transfers.seen == (["Tensor.copy_"] if in_bucket else ["upload"])
