"""The accept stage: a step's verdicts come to the host in one read (greedy and sampled chains, greedy trees,
plain rows), and batching them changes no request's tokens: each equals its own rule applied alone."""
import torch
from host_reads import HostReads

from smartspec.runtime.model_runner import ForwardItem
from smartspec.runtime.sampler import target_probs
from smartspec.spec_decode.accept import accept_drafts
from smartspec.spec_decode.proposer import Draft
from smartspec.spec_decode.rejection_sampler import accept_greedy, accept_sampled, accept_tree_greedy
from smartspec.types.request import Request
from smartspec.types.sampling_params import SamplingParams
from smartspec.types.tree import TokenTree

V = 11


def a_step(seed: int):
    """Five requests: a greedy chain, a sampled chain (draft probabilities), a greedy tree, a greedy and a sampled
    request without drafts; their items, logits and drafts."""
    g = torch.Generator().manual_seed(seed)

    def request(rid, params):
        r = Request(rid, [1, 2, 3], params)
        if params.seed is not None:
            r.generator = torch.Generator().manual_seed(params.seed)
        return r

    greedy, sampled = SamplingParams(), SamplingParams(temperature=0.9, top_k=6, seed=seed)
    tree = TokenTree([4, 5, 6], [-1, -1, 0], [0.5] * 3)
    q = torch.softmax(torch.randn(3, V, generator=g), -1)
    drafts = {"chain": Draft([4, 7, 1], None), "sampled": Draft([2, 9, 3], q),
              "tree": Draft(tree.tokens, None, tree)}
    reqs = [request("chain", greedy), request("sampled", sampled), request("tree", greedy),
            request("plain", greedy), request("plain_sampled", SamplingParams(temperature=1.1, seed=seed + 1))]
    rows = [4, 4, 4, 1, 1]
    items = [ForwardItem(r, [0] * n, 3, n) for r, n in zip(reqs, rows)]
    logits = torch.randn(sum(rows), V, generator=g) * 2
    logits[0, 4] += 20  # the greedy chain's first two drafts are the target's argmax
    logits[1, 7] += 20
    return items, logits, drafts


def test_a_step_reads_the_host_once(monkeypatch):
    items, logits, drafts = a_step(0)
    reads = []
    original = torch.Tensor.tolist

    def counted(self):
        reads.append(tuple(self.shape))
        return original(self)
    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    with HostReads() as syncs:
        out = accept_drafts(items, logits, drafts)
    assert len(reads) == 1  # the step's one read
    assert [op for op in syncs.seen if op != "lift_fresh"] == []  # uploads (draft tokens, row lists) are not reads
    assert set(out) == {"chain", "sampled", "tree", "plain", "plain_sampled"}


def test_batched_verdicts_equal_each_rule_alone():
    for seed in range(20):
        items, logits, drafts = a_step(seed)
        out = accept_drafts(items, logits, drafts)
        _, _, fresh = a_step(seed)  # the same generators, unused
        again, _, _ = a_step(seed)
        rows = {"chain": logits[0:4], "sampled": logits[4:8], "tree": logits[8:12]}
        assert out["chain"] == accept_greedy(rows["chain"], drafts["chain"].tokens)
        assert out["chain"][:2] == [4, 7]
        assert out["tree"] == accept_tree_greedy(rows["tree"], drafts["tree"].tree)
        assert out["plain"] == [int(logits[12].argmax())]
        sampled = again[1].request
        assert out["sampled"] == accept_sampled(target_probs(rows["sampled"], sampled.params), drafts["sampled"].tokens,
                                                drafts["sampled"].probs, sampled.generator)
        plain = again[4].request
        assert out["plain_sampled"] == [int(torch.multinomial(target_probs(logits[13], plain.params), 1,
                                                                generator=plain.generator))]
