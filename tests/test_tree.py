"""Token-tree speculation: masks, tree attention, KV compaction, greedy losslessness in mixed batches, the recursive
rejection sampler's distribution, and tree goodput."""
import math

import numpy as np
import pytest
import torch

from smartspec import SamplingParams
from smartspec.engine.llm_engine import tree_item
from smartspec.engine.model_runner import ForwardItem
from smartspec.engine.request import Request
from smartspec.policy.tree_goodput import NodeCalibration, node_values, prune_trees
from smartspec.spec.ngram import NgramTreeProposer
from smartspec.spec.rejection_sampler import accept_tree, accept_tree_greedy
from smartspec.spec.tree import TokenTree, best_first
from test_speculative import PARAMS, PROMPTS, MixedPolicy, make, run_staggered

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
    eng, draft, ref = llm.engine, llm.engine.speculator.proposer, make(tiny_qwen).engine
    eng.add_request(PROMPTS[0], SamplingParams(max_tokens=30, ignore_eos=True), request_id="r-0")
    moved, catchup = 0, []
    while eng.has_unfinished():
        eng.step()
        req, trees = eng.requests.get("r-0"), eng.last_step.extra.get("trees", {})
        if req is None or not trees:
            continue
        catchup.append(eng.last_step.draft_catchup_tokens)
        path = trees["r-0"][1]
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
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_tree_output_equals_plain_with_chains_and_k0_in_one_batch(method, tiny_qwen, tiny_qwen_draft,
                                                                         plain_outputs):
    spec = {"method": method, "tree": TREE, "policy": MixedPolicy()}
    if method == "draft_model":
        spec["model"] = tiny_qwen_draft
    llm = make(tiny_qwen, spec)
    shapes = []  # per step: which kinds of speculation the batch held
    propose = llm.engine.speculator.propose

    def observed(decoding, ks):
        drafts = propose(decoding, ks)
        kinds = {"k0" if r.request_id not in drafts else
                 ("chain" if drafts[r.request_id].tree.is_chain else "tree") for r in decoding}
        shapes.append(kinds)
        return drafts

    llm.engine.speculator.propose = observed
    assert run_staggered(llm, PROMPTS, PARAMS) == plain_outputs
    assert any({"k0", "chain", "tree"} <= kinds for kinds in shapes), shapes
    m = llm.engine.speculator.metrics
    assert 0 < m.num_accepted_tokens < m.num_draft_tokens
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks
    if method == "draft_model":
        draft = llm.engine.speculator.proposer
        assert draft.blocks.num_free == draft.blocks.num_blocks and not draft.state and not draft.grown


@pytest.fixture(scope="module")
def plain_outputs(tiny_qwen):
    return [o.token_ids for o in make(tiny_qwen).generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_tree_under_smartspec_equals_plain(method, tiny_qwen, tiny_qwen_draft, plain_outputs):
    spec = {"method": method, "tree": TREE, "policy": "smartspec"}
    if method == "draft_model":
        spec["model"] = tiny_qwen_draft
    llm = make(tiny_qwen, spec)
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == plain_outputs


@pytest.mark.parametrize("bad,message", [
    ({"max_nodes": 64}, "max_nodes"), ({"max_depth": 0}, "max_depth"), ({"branching": 8, "max_depth": 10}, "branching"),
    ({"width": 2}, "unknown tree keys"),
])
def test_bad_tree_config_is_rejected(tiny_qwen, bad, message):
    with pytest.raises(ValueError, match=message):
        make(tiny_qwen, {"method": "ngram", "tree": bad})


# ---- sampled acceptance: the output follows the target --------------------------------------------------------------
V = 6
P_ROOT = torch.tensor([0.30, 0.25, 0.20, 0.12, 0.08, 0.05])
Q_ROOT = torch.tensor([0.05, 0.10, 0.40, 0.25, 0.15, 0.05])  # a poor draft: its mass is where the target's is not


def _p_next(x: int) -> torch.Tensor:
    return torch.roll(P_ROOT, x)


def _q_next(x: int) -> torch.Tensor:
    return torch.roll(Q_ROOT, 2 * x)


def _draw(q: torch.Tensor, n: int, gen: torch.Generator) -> list[int]:
    keys = q.log() - (-torch.rand(q.shape, generator=gen).log()).log()  # Gumbel top-n: without replacement
    return torch.topk(keys, n).indices.tolist()


def _random_tree(gen):
    """Three root children drawn without replacement from Q_ROOT, two grandchildren under each."""
    tokens, parents, probs = [], [], {-1: Q_ROOT}
    for x in _draw(Q_ROOT, 3, gen):
        tokens.append(x)
        parents.append(-1)
    for c in range(3):
        probs[c] = _q_next(tokens[c])
        for y in _draw(probs[c], 2, gen):
            tokens.append(y)
            parents.append(c)
    tree = TokenTree(tokens, parents, [0.5] * len(tokens), probs)
    rows = [P_ROOT] + [_p_next(tokens[i]) if parents[i] < 0 else P_ROOT for i in range(len(tokens))]
    return tree, torch.stack(rows).log()


def _wrong_accept(logits, tree, params, gen):
    """Tries every sibling against the full target instead of the residual left by the rejected ones."""
    p = torch.softmax(logits, -1)
    out, node = [], -1
    while True:
        q, kids = tree.child_probs.get(node), tree.children(node)
        if not kids:
            out.append(int(torch.multinomial(p[node + 1], 1, generator=gen)))
            return out
        for child in kids:
            tok = tree.tokens[child]
            if float(torch.rand((), generator=gen)) * float(q[tok]) < float(p[node + 1][tok]):
                out.append(tok)
                node = child
                break
        else:
            out.append(int(torch.multinomial(torch.clamp(p[node + 1] - q, min=0) + 1e-12, 1, generator=gen)))
            return out


def _chi2_pvalue(counts: np.ndarray, expected: np.ndarray) -> float:
    stat = float(((counts - expected) ** 2 / expected).sum())
    k = len(counts) - 1  # Wilson-Hilferty: chi2(k) ~ k (1 - 2/9k + z sqrt(2/9k))^3
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize("sampler,should_pass", [(accept_tree, True), (_wrong_accept, False)])
def test_recursive_rejection_sampling_follows_the_target(sampler, should_pass):
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0)
    n = 12000
    counts = np.zeros(V * V)
    for _ in range(n):
        tree, logits = _random_tree(gen)
        out = sampler(logits, tree, params, gen)
        if len(out) < 2:  # the first token was resampled: draw the second from the target, as the next step would
            out.append(int(torch.multinomial(_p_next(out[0]), 1, generator=gen)))
        counts[out[0] * V + out[1]] += 1
    expected = np.array([float(P_ROOT[x] * _p_next(x)[y]) for x in range(V) for y in range(V)]) * n
    p_value = _chi2_pvalue(counts, expected)
    assert (p_value > 1e-4) == should_pass, p_value  # a false alarm 1 time in 10,000


def test_recursive_rejection_sampling_with_fixed_siblings_follows_the_target():
    """Prompt-lookup trees under sampling: deterministic siblings (q one-hot at each), tried in order."""
    gen = torch.Generator().manual_seed(1)
    tree = TokenTree([2, 0, 4, 1, 5, 3], [-1, -1, -1, 0, 0, 1], [0.5] * 6)  # no child_probs: fixed tokens
    rows = [P_ROOT] + [_p_next(tree.tokens[i]) if tree.parents[i] < 0 else P_ROOT for i in range(len(tree))]
    logits = torch.stack(rows).log()
    n = 12000
    counts = np.zeros(V * V)
    for _ in range(n):
        out = accept_tree(logits, tree, SamplingParams(temperature=1.0), gen)
        if len(out) < 2:
            out.append(int(torch.multinomial(_p_next(out[0]), 1, generator=gen)))
        counts[out[0] * V + out[1]] += 1
    expected = np.array([float(P_ROOT[x] * _p_next(x)[y]) for x in range(V) for y in range(V)]) * n
    assert _chi2_pvalue(counts, expected) > 1e-4


def test_greedy_tree_acceptance_walks_the_argmax_path():
    tree = TokenTree([1, 2, 3, 4], [-1, -1, 1, 1], [0.5] * 4)
    logits = torch.full((5, V), -5.0)
    for row, tok in ((0, 2), (2, 4), (4, 5)):  # after root: 2 (node 1), after node 1: 4 (node 3), then 5
        logits[row, tok] = 5.0
    assert accept_tree_greedy(logits, tree) == [2, 4, 5]


# ---- goodput for trees ----------------------------------------------------------------------------------------------
def test_calibration_learns_acceptance_by_confidence():
    cal = NodeCalibration()
    rng = np.random.default_rng(0)
    for _ in range(3000):
        # an over-confident drafter: nodes it gives 0.9 are accepted 40% of the time
        tree = TokenTree([1], [-1], [0.9])
        cal.observe(tree, [0] if rng.random() < 0.4 else [])
    assert cal.probability(0.9) == pytest.approx(0.4, abs=0.05)
    assert cal.probability(0.15) == pytest.approx(0.15)  # no evidence: the confidence itself


def test_pruning_keeps_valuable_nodes_when_verification_is_cheap_and_none_when_steep():
    cal = NodeCalibration()
    trees = [TokenTree([1, 2, 3, 4], [-1, -1, 0, 2], [0.9, 0.05, 0.9, 0.9]), TokenTree([5], [-1], [0.1])]
    values = [node_values(t, cal) for t in trees]
    cheap = lambda n, c: 0.010 + 0.001 * n  # noqa: E731
    kept, _ = prune_trees(trees, values, cheap, 2, 100, draft_s=0.002)
    assert kept[0].tokens == [1, 3, 4] and len(kept[1]) == 0  # the confident chain; not the 0.05 or 0.1 nodes
    free = lambda n, c: 0.010 + 0 * n  # noqa: E731
    kept, _ = prune_trees(trees, values, free, 2, 100, draft_s=0.002)
    assert [len(t) for t in kept] == [4, 1]
    steep = lambda n, c: 0.010 + 0.2 * n  # noqa: E731
    kept, _ = prune_trees(trees, values, steep, 2, 100, draft_s=0.002)
    assert [len(t) for t in kept] == [0, 0]


def test_tree_from_a_draft_actor_equals_plain(ray_serve, tiny_qwen, tiny_qwen_draft, plain_outputs):
    """The serving layer's draft actor grows the trees (and compacts its cache) on its side of Ray."""
    import ray

    from deployments.draft_worker import DraftWorker, RemoteDraftProposer
    from smartspec import EngineConfig
    from smartspec.engine.llm_engine import LLMEngine

    def draft_actor(spec, engine, num_blocks):
        actor = ray.remote(DraftWorker).options(num_cpus=0.1).remote(
            spec.model, tiny_qwen, engine.vocab_size, num_blocks, engine.config.block_size, engine.config.use_kernels,
            "float32", "cpu", 1, {"max_depth": spec.tree.max_depth, "branching": spec.tree.branching})
        return RemoteDraftProposer(actor)

    engine = LLMEngine(EngineConfig(model=tiny_qwen, num_kv_blocks=128, block_size=4, max_model_len=256,
                                    speculative_config={"method": "draft_model", "model": tiny_qwen_draft,
                                                        "tree": TREE, "policy": MixedPolicy()}),
                       proposer_factory=draft_actor)
    llm = type("Offline", (), {"engine": engine})()
    try:
        assert run_staggered(llm, PROMPTS, PARAMS) == plain_outputs
        m = engine.speculator.metrics
        assert 0 < m.num_accepted_tokens < m.num_draft_tokens
    finally:
        engine.close()


def test_calibration_is_shared_between_replicas_without_echo():
    from smartspec.policy import SmartSpecPolicy, merge_states

    a, b = SmartSpecPolicy(key="k:tree", tree_depth=3), SmartSpecPolicy(key="k:tree", tree_depth=3)
    for _ in range(200):  # replica a learns that its drafter's 0.95 nodes are rejected
        a.calibration.observe(TokenTree([1], [-1], [0.95]), [])
    b.import_state(merge_states([a.export_state()]))
    assert b.calibration.probability(0.95) < 0.1
    assert sum(b.export_state()["calibration"]["total"]) == 0  # b exports its own evidence only


def test_node_budgets_follow_the_last_trees_values():
    from smartspec.policy import SmartSpecPolicy

    policy = SmartSpecPolicy(tree_depth=3)
    policy.cost.v = [0.010, 0.0002, 0.0002, 0.0002, 0.0002, 0.0002, 0.0002, 0.0]  # cheap verification
    reqs = [Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=64)) for i in range(2)]
    policy.choose(reqs, 8)
    confident = TokenTree([1, 2, 3, 4, 5], [-1, 0, 1, 2, 3], [0.99] * 5)  # r0's drafter is sure of a long path
    doubtful = TokenTree([6], [-1], [0.02])  # r1's is not
    policy.prune(reqs, [8, 8], [confident, doubtful], draft_s=0.001)
    before = policy.tree_gains.curve("r0").copy()
    policy.prune(reqs, [0, 8], [TokenTree([], [], []), doubtful], draft_s=0.001)  # r0 asked for nothing
    assert np.array_equal(policy.tree_gains.curve("r0"), before)
    ks = policy.choose(reqs, 8)
    assert ks[0] >= 4 and ks[1] <= 1, ks
