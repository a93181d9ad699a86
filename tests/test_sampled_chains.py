"""A step's sampled chains verified together (spec_decode/sampled_chains.py): each chain's verdict bitwise
sampled_verdict's alone with the same generator, for chains of every length, with draft probabilities (k or k + 1
rows: a cut draft) or deterministic, mixed in one batch; and the uniforms and the draw come from each request's own
generator in the rule's order."""
import numpy as np
import torch

from smartspec.runtime.upload import HostBatch
from smartspec.spec_decode.proposer import Draft
from smartspec.spec_decode.rejection_sampler import sampled_verdict
from smartspec.spec_decode.sampled_chains import StagedChains

V = 23


def random_chain(rng: np.random.Generator, g: torch.Generator) -> tuple[torch.Tensor, Draft]:
    """A chain of 1-5 drafts: its target probabilities [k + 1, V] (some near the draft, so runs get accepted) and
    its draft: deterministic, or with probabilities of k rows, or k + 1 (cut by a grammar)."""
    k = int(rng.integers(1, 6))
    q_rows = int(rng.choice([0, k, k + 1]))
    logits = torch.randn(k + 1, V, generator=g) * float(rng.choice([0.5, 2.0, 6.0]))
    tokens = [int(t) for t in rng.integers(0, V, k)]
    if rng.random() < 0.5:  # the target favours the draft
        for j, t in enumerate(tokens):
            logits[j, t] += 4.0
    p = torch.softmax(logits, dim=-1)
    q = None if q_rows == 0 else torch.softmax(logits[:q_rows] + torch.randn(q_rows, V, generator=g), dim=-1)
    return p, Draft(tokens, q)


def test_each_chains_verdict_is_bitwise_the_rules_alone():
    rng, g = np.random.default_rng(0), torch.Generator().manual_seed(0)
    accepted_runs = set()
    for trial in range(120):
        chains = [random_chain(rng, g) for _ in range(int(rng.integers(2, 8)))]  # one alone: the rule itself
        p = torch.cat([pc for pc, _ in chains])
        starts = np.cumsum([0] + [pc.shape[0] for pc, _ in chains[:-1]]).tolist()
        batch = HostBatch()
        staged = StagedChains([d for _, d in chains], starts, batch)
        ours = [torch.Generator().manual_seed(1000 * trial + i) for i in range(len(chains))]
        theirs = [torch.Generator().manual_seed(1000 * trial + i) for i in range(len(chains))]
        got = staged.verdicts(p, ours, batch.send(p.device)).tolist()
        for (pc, draft), generator, verdict in zip(chains, theirs, got):
            assert verdict == sampled_verdict(pc, draft.tokens, draft.probs, generator).tolist()
            accepted_runs.add((verdict[0] == len(draft.tokens), verdict[0] == 0))
        for a, b in zip(ours, theirs):  # each generator left where the rule alone leaves it
            assert torch.equal(a.get_state(), b.get_state())
    assert accepted_runs == {(True, False), (False, True), (False, False)}  # all, none and some accepted, all seen
