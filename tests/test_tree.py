"""Token-tree speculation: masks, tree attention, KV compaction, greedy losslessness in mixed batches (in-process
and from a draft actor). The recursive rejection sampler: test_rejection_sampler.py; tree goodput:
test_tree_goodput.py."""

import pytest
import torch
from engines import PARAMS, PROMPTS, MixedPolicy, make, run_staggered

from smartspec import SamplingParams
from smartspec.engine.llm_engine import tree_item
from smartspec.runtime.model_runner import ForwardItem
from smartspec.spec_decode.ngram import NgramTreeProposer
from smartspec.types.request import Request
from smartspec.types.tree import TokenTree, best_first

TREE = {"max_nodes": 8, "max_depth": 3, "branching": 2}


# ---- the tree and its mask ---------------------------------------------------------------------------------------
def test_masks_show_ancestors_and_never_siblings():
    #        root
    #       /    \
    #      0      1
    #     / \      \
    #    2   3      4
    tree = TokenTree([10, 11, 12, 13, 14], [-1, -1, 0, 0, 1], [0.5] * 5)
    masks = tree.ancestor_masks()
    assert masks == [0b1, 0b11, 0b101, 0b1011, 0b10011, 0b100101]
    assert tree.depths() == [1, 1, 2, 2, 2]
    assert not masks[1 + 1] & (1 << 1)  # node 1 cannot see its sibling 0
    assert not masks[1 + 3] & (1 << 3)  # node 3 cannot see its sibling 2
    assert tree.follow([10, 13, 99]) == [0, 3] and tree.follow([11, 14]) == [1, 4] and tree.follow([99]) == []
    assert tree.select([0, 1, 3]).parents == [-1, -1, 0]
    with pytest.raises(ValueError, match="parent"):
        tree.select([2])
    full = TokenTree(list(range(63)), list(range(-1, 62)), [1.0] * 63)
    assert full.ancestor_masks()[-1] == -1  # all 64 bits, as a signed int64


def test_best_first_keeps_a_tree_and_sibling_order():
    # candidates: root children a (0.6), b (0.3); a's children c (0.5 -> 0.3), d (0.4 -> 0.24)
    tokens, parents, scores = [1, 2, 3, 4], [-1, -1, 0, 0], [0.6, 0.3, 0.3, 0.24]
    tree = best_first(tokens, parents, scores, [0.6, 0.3, 0.5, 0.4], limit=3)
    assert tree.tokens == [1, 2, 3] and tree.parents == [-1, -1, 0]
    # sampled siblings keep their draw order: a later sibling of higher probability never displaces an earlier one
    tree = best_first([1, 2, 3], [-1, -1, -1], [0.1, 0.5, 0.4], [0.1, 0.5, 0.4], limit=2, sibling_order=True)
    assert tree.tokens == [1, 2]


def test_a_trees_walks_match_a_scan_of_its_parents():
    """children, child, follow and the greedy path (kept indexes) against a scan of every node, on random trees
    of every shape best_first and select make, walked by token sequences that stop anywhere."""
    import random

    from smartspec.spec_decode.rejection_sampler import greedy_path
    from smartspec.types.tree import count_trie

    def scanned_follow(tree, tokens):
        path, node = [], -1
        for tok in tokens:
            nxt = next((c for c in range(len(tree)) if tree.parents[c] == node and tree.tokens[c] == tok), None)
            if nxt is None:
                return path
            path.append(nxt)
            node = nxt
        return path

    rng = random.Random(7)
    for _ in range(300):
        follows = [[rng.randrange(5) for _ in range(rng.randint(1, 5))] for _ in range(rng.randint(1, 9))]
        tokens, parents, counts = count_trie(follows, rng.choice([None, 2, 3]))
        tree = best_first(tokens, parents, [rng.random() for _ in tokens], [1.0] * len(tokens),
                          limit=rng.randint(1, 12))
        if len(tree) > 2 and rng.random() < 0.5:
            keep = sorted({i for i in rng.sample(range(len(tree)), 2) for i in _with_ancestors(tree, i)})
            tree = tree.select(keep)
        for node in range(-1, len(tree)):
            assert list(tree.children(node)) == [i for i, p in enumerate(tree.parents) if p == node]
            for tok in range(6):
                found = [i for i in tree.children(node) if tree.tokens[i] == tok]
                assert tree.child(node, tok) == (found[0] if found else None)
        for walk in follows + [[rng.randrange(6) for _ in range(6)] for _ in range(3)]:
            path = scanned_follow(tree, walk)
            assert tree.follow(walk) == path
            best = [rng.randrange(6) for _ in range(len(tree) + 1)]
            greedy, node = [], -1
            while True:
                greedy.append(best[node + 1])
                node = next((c for c in tree.children(node) if tree.tokens[c] == best[node + 1]), None)
                if node is None:
                    break
            assert greedy_path(best, tree) == greedy


def _with_ancestors(tree, node):
    while node >= 0:
        yield node
        node = tree.parents[node]


def test_ngram_tree_merges_matches():
    proposer = NgramTreeProposer(max_depth=3, branching=4, n_max=2, n_min=1)
    tokens = [7, 1, 2, 9, 7, 1, 3, 9, 7, 1, 2, 8, 7, 1]
    tree = proposer.tree(tokens, budget=8)
    # [7, 1] was followed by 2 9 7 / 3 9 7 / 2 8 7: a tree with branches 2 (two matches) and 3
    roots = {tree.tokens[i]: i for i in tree.children(-1)}
    assert sorted(roots) == [2, 3]
    assert tree.confidences[roots[2]] == pytest.approx(2 / 3) and tree.confidences[roots[3]] == pytest.approx(1 / 3)
    assert sorted(tree.tokens[i] for i in tree.children(roots[2])) == [8, 9]
    assert len(tree) == 8 and tree.follow([2, 9, 7]) != tree.follow([2, 8, 7])
    small = proposer.tree(tokens, budget=2)  # the two best nodes: 2 (2/3 of matches), then 2 -> 8 or 2 -> 9 (1/3)
    assert len(small) == 2 and small.tokens[0] == 2 and small.parents == [-1, 0]


# ---- tree attention and KV compaction -----------------------------------------------------------------------------
def _runner(path):
    return make(path).engine  # a plain engine: its runner and blocks


def test_tree_forward_equals_each_path_alone(tiny_qwen):
    """Every node's logits equal those of its path fed as a plain chain, bitwise: a node sees its ancestors and
    nothing else (a sibling in view would change them)."""
    eng = _runner(tiny_qwen)
    prompt = eng.tokenize("def tree(x): return")
    tree = TokenTree([40, 41, 42, 43, 44], [-1, -1, 0, 0, 1], [0.5] * 5)
    req = Request("t", prompt, SamplingParams())
    eng.blocks.allocate(req, len(prompt) + len(tree))
    eng.runner.forward([ForwardItem(req, prompt[:-1], 0, 0)])
    req.num_computed_tokens = len(prompt) - 1
    got = eng.runner.forward([tree_item(req, tree)])
    for node in range(-1, len(tree)):
        path = [] if node < 0 else [n for n in _path(tree, node)]
        chain = Request(f"c{node}", prompt, SamplingParams())
        eng.blocks.allocate(chain, len(prompt) + len(path))
        want = eng.runner.forward([ForwardItem(chain, prompt + [tree.tokens[n] for n in path], 0, 1)])
        eng.blocks.free(chain)
        assert torch.equal(got[node + 1], want[0]), f"node {node}"


def _path(tree, node):
    out = []
    while node >= 0:
        out.append(node)
        node = tree.parents[node]
    return out[::-1]


def test_tree_mask_on_the_torch_attention_path(tiny_qwen, monkeypatch):
    """The reference attention (no compiled kernels: GPUs) masks the same way (to fp32 rounding)."""
    eng = make(tiny_qwen, use_kernels=False).engine
    prompt = eng.tokenize("abc abc")
    tree = TokenTree([40, 41, 42], [-1, -1, 0], [0.5] * 3)
    req = Request("t", prompt, SamplingParams())
    eng.blocks.allocate(req, len(prompt) + 3)
    eng.runner.forward([ForwardItem(req, prompt[:-1], 0, 0)])
    req.num_computed_tokens = len(prompt) - 1
    got = eng.runner.forward([tree_item(req, tree)])
    for node, path in ((1, [41]), (2, [40, 42])):
        chain = Request(f"c{node}", prompt, SamplingParams())
        eng.blocks.allocate(chain, len(prompt) + len(path))
        want = eng.runner.forward([ForwardItem(chain, prompt + path, 0, 1)])[0]
        eng.blocks.free(chain)
        torch.testing.assert_close(got[node + 1], want, rtol=1e-4, atol=1e-4)


def test_accepted_path_kv_is_compacted_in_target_and_draft(tiny_qwen):
    """With the target as its own draft, the accepted path is the draft's top path, which is not stored first
    (the root's other children come before it): after each step the cache must hold exactly what a plain prefill
    of the committed tokens writes, in the target and in the draft, and the draft never re-reads accepted tokens."""
    llm = make(tiny_qwen, {"method": "draft_model", "model": tiny_qwen, "tree": TREE, "policy": "fixed"})
    eng, draft, ref = llm.engine, llm.engine.speculation.proposer, make(tiny_qwen).engine
    eng.add_request(PROMPTS[0], SamplingParams(max_tokens=30, ignore_eos=True), request_id="r-0")
    moved, catchup = 0, []
    while eng.has_unfinished():
        eng.step()
        req, trees = eng.requests.get("r-0"), eng.last_step.trees
        if req is None or not trees:
            continue
        catchup.append(eng.last_step.draft_catchup_tokens)
        path = trees["r-0"].path
        moved += path != list(range(len(path)))
        n = req.num_computed_tokens
        ref_req = Request("ref", req.token_ids[:n], SamplingParams())
        ref.blocks.allocate(ref_req, n)
        ref.runner.forward([ForwardItem(ref_req, req.token_ids[:n], 0, 1)])
        ds = draft.state["r-0"]
        assert ds.num_computed_tokens >= n - 1  # the draft kept its accepted path (all but a never-fed leaf)
        for runner, r, upto in ((eng.runner, req, n), (draft.runner, ds, ds.num_computed_tokens)):
            slots = torch.tensor([runner.blocks.slot(r, p) for p in range(upto)])
            ref_slots = torch.tensor([ref.blocks.slot(ref_req, p) for p in range(upto)])
            for (k, v), (rk, rv) in zip(runner.kv_caches, ref.runner.kv_caches):
                assert torch.equal(k.view(-1, *k.shape[2:])[slots], rk.view(-1, *rk.shape[2:])[ref_slots])
                assert torch.equal(v.view(-1, *v.shape[2:])[slots], rv.view(-1, *rv.shape[2:])[ref_slots])
        ref.blocks.free(ref_req)
    assert moved > 0, "no step accepted a path that needed moving: the test did not test compaction"
    # after the prompt, the draft reads each step's new root and at most the accepted leaf it never fed
    assert catchup[0] > 0 and all(c <= 1 for c in catchup[1:]), catchup


# ---- greedy losslessness ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["ngram", "draft_model", "suffix"])
def test_greedy_tree_output_equals_plain_with_chains_and_k0_in_one_batch(method, tiny_qwen, tiny_qwen_draft,
                                                                         plain_outputs):
    spec = {"method": method, "tree": TREE, "policy": MixedPolicy()}
    if method == "draft_model":
        spec["model"] = tiny_qwen_draft
    llm = make(tiny_qwen, spec)
    shapes = []  # per step: which kinds of speculation the batch held
    engine, run_step = llm.engine, llm.engine.run_step

    def observed(spec, step_number=0, *beside):
        result = run_step(spec, step_number, *beside)
        record = result.record
        if record is not None and record.request_ids:
            # a decoding request with k > 0 but no draft verified k0, like those at k = 0
            shapes.append({"k0" if not p else ("tree" if rid in record.trees and not record.trees[rid].tree.is_chain
                                               else "chain")
                           for rid, p in zip(record.request_ids, record.proposed)})
        return result

    engine.run_step = observed
    assert run_staggered(llm, PROMPTS, PARAMS) == plain_outputs
    assert any({"k0", "chain", "tree"} <= kinds for kinds in shapes), shapes
    m = llm.engine.speculation.metrics
    assert 0 < m.num_accepted_tokens < m.num_draft_tokens
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks
    if method == "draft_model":
        draft = llm.engine.speculation.proposer
        assert draft.blocks.num_free == draft.blocks.num_blocks and not draft.state and not draft.grown


@pytest.fixture(scope="module")
def plain_outputs(tiny_qwen):
    return [o.token_ids for o in make(tiny_qwen).generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("method", ["ngram", "draft_model", "suffix"])
def test_greedy_tree_under_smartspec_equals_plain(method, tiny_qwen, tiny_qwen_draft, plain_outputs):
    spec = {"method": method, "tree": TREE, "policy": "smartspec"}
    if method == "draft_model":
        spec["model"] = tiny_qwen_draft
    llm = make(tiny_qwen, spec)
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == plain_outputs


def test_a_tree_drafter_catches_up_in_pieces_and_stays_lossless(tiny_qwen, tiny_qwen_draft, plain_outputs,
                                                                 monkeypatch):
    """Pieces of 3 tokens (the real ones are 256): every forward that reads a context, not a tree, is at most 3
    tokens a request, and the greedy output is plain decoding's."""
    import smartspec.spec_decode.draft_model as draft_model
    monkeypatch.setattr(draft_model, "CATCHUP_CHUNK", 3)
    llm = make(tiny_qwen, {"method": "draft_model", "model": tiny_qwen_draft, "tree": TREE, "policy": "fixed"})
    draft, widths = llm.engine.speculation.proposer, []
    real_forward = draft.runner.forward
    monkeypatch.setattr(draft.runner, "forward", lambda items: widths.extend(
        len(i.tokens) for i in items if i.tree_masks is None) or real_forward(items))
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == plain_outputs
    assert widths and max(widths) == 3, widths


@pytest.mark.parametrize("bad,message", [
    ({"max_nodes": 64}, "max_nodes"), ({"max_depth": 0}, "max_depth"), ({"branching": 8, "max_depth": 10}, "branching"),
    ({"width": 2}, "unknown tree keys"),
])
def test_bad_tree_config_is_rejected(tiny_qwen, bad, message):
    with pytest.raises(ValueError, match=message):
        make(tiny_qwen, {"method": "ngram", "tree": bad})


# ---- sampled acceptance: the output follows the target --------------------------------------------------------------


def test_tree_from_a_draft_actor_equals_plain(ray_serve, tiny_qwen, tiny_qwen_draft, plain_outputs):
    """The serving layer's draft actor grows the trees (and compacts its cache) on its side of Ray."""
    from dataclasses import replace

    import ray

    from deployments.replica.draft_worker import DraftWorker, RemoteDraftProposer
    from smartspec import EngineConfig
    from smartspec.engine.llm_engine import LLMEngine

    def draft_actor(spec, runtime):
        actor = ray.remote(DraftWorker).options(num_cpus=0.1).remote(
            spec.draft_only(), replace(runtime, target_tokenizer=None), tiny_qwen, 1)
        return RemoteDraftProposer(actor)

    engine = LLMEngine(EngineConfig(model=tiny_qwen, num_kv_blocks=128, block_size=4, max_model_len=256,
                                    speculative_config={"method": "draft_model", "model": tiny_qwen_draft,
                                                        "tree": TREE, "policy": MixedPolicy()}),
                       draft_factory=draft_actor)
    llm = type("Offline", (), {"engine": engine})()
    try:
        assert run_staggered(llm, PROMPTS, PARAMS) == plain_outputs
        m = engine.speculation.metrics
        assert 0 < m.num_accepted_tokens < m.num_draft_tokens
    finally:
        engine.close()


def test_the_tree_drafter_reads_the_host_once_a_depth(tiny_qwen, tiny_qwen_draft, monkeypatch):
    """Growing trees for a batch (greedy and sampled requests) brings each depth's candidates to the host in one
    read, not a few per child."""
    import sys
    reads = []
    for name in ("tolist", "item", "__float__", "__int__"):
        def counted(self, *args, _original=getattr(torch.Tensor, name), _name=name):
            if sys._getframe(1).f_code.co_filename.endswith("draft_tree.py"):
                reads.append(_name)
            return _original(self, *args)
        monkeypatch.setattr(torch.Tensor, name, counted)
    llm = make(tiny_qwen, {"method": "draft_model", "model": tiny_qwen_draft, "tree": TREE, "policy": "fixed"})
    eng, draft = llm.engine, llm.engine.speculation.proposer
    requests = []
    for i, params in enumerate([SamplingParams(max_tokens=8), SamplingParams(max_tokens=8, temperature=0.8, seed=1)]):
        eng.add_request(PROMPTS[i], params, request_id=f"r{i}")
        requests.append(eng.requests.get(f"r{i}"))
    eng.step()  # the prompts
    reads.clear()
    proposal = draft.propose(requests, [8, 8])
    assert all(len(t) for t in proposal.trees)
    assert reads == ["tolist"] * draft.max_depth
