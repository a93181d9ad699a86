"""The accept stage: a step's verdicts come to the host in one read (greedy and sampled chains, greedy trees,
plain rows), and batching them changes no request's tokens: each equals its own rule applied alone."""
import torch
from host_reads import HostReads

from smartspec.runtime.model_runner import ForwardItem
from smartspec.runtime.sampler import seeded_tokens, target_probs
from smartspec.spec_decode.accept import accept_drafts
from smartspec.spec_decode.proposer import Draft
from smartspec.spec_decode.rejection_sampler import (accept_greedy, accept_sampled, accept_tree_greedy, greedy_path,
                                                     greedy_run)
from smartspec.types.request import Request
from smartspec.types.sampling_params import SamplingParams
from smartspec.types.tree import TokenTree

V = 11


def a_step(seed: int):
    """Seven requests: a greedy chain, a sampled chain (draft probabilities), a greedy tree, a greedy and a sampled
    request without drafts, a seeded chain and a seeded tree; their items, logits and drafts. The unseeded sampled
    requests draw from generators of their own, seeded here so the test can repeat their draws."""
    g = torch.Generator().manual_seed(seed)

    def request(rid, params, generator_seed=None):
        r = Request(rid, [1, 2, 3], params)
        if generator_seed is not None:
            r.generator = torch.Generator().manual_seed(generator_seed)
        return r

    greedy, sampled = SamplingParams(), SamplingParams(temperature=0.9, top_k=6)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=seed)
    tree = TokenTree([4, 5, 6], [-1, -1, 0], [0.5] * 3)
    q = torch.softmax(torch.randn(3, V, generator=g), -1)
    drafts = {"chain": Draft([4, 7, 1], None), "sampled": Draft([2, 9, 3], q),
              "tree": Draft(tree.tokens, None, tree), "seeded": Draft([3, 8, 0], q),
              "seeded_tree": Draft(tree.tokens, None, tree)}
    reqs = [request("chain", greedy), request("sampled", sampled, seed), request("tree", greedy),
            request("plain", greedy), request("plain_sampled", SamplingParams(temperature=1.1), seed + 1),
            request("seeded", seeded), request("seeded_tree", seeded)]
    rows = [4, 4, 4, 1, 1, 4, 4]
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
    with Copies(monkeypatch) as syncs:
        out = accept_drafts(items, logits, drafts).tokens
    assert len(reads) == 1  # the step's one read
    assert syncs.seen == []  # no read, and no host value sent but through runtime/upload.py
    assert set(out) == {"chain", "sampled", "tree", "plain", "plain_sampled", "seeded", "seeded_tree"}


def test_batched_verdicts_equal_each_rule_alone():
    for seed in range(20):
        items, logits, drafts = a_step(seed)
        out = accept_drafts(items, logits, drafts).tokens
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
        # seeded requests: greedy verification against the Gumbel-max tokens of noise keyed by (seed, position)
        seeded = again[5].request
        chosen = seeded_tokens(target_probs(logits[14:18], seeded.params), seed, [3, 4, 5, 6])
        assert out["seeded"] == greedy_run(chosen.tolist(), drafts["seeded"].tokens)
        tree = drafts["seeded_tree"].tree
        chosen = seeded_tokens(target_probs(logits[18:22], seeded.params), seed, [3] + [3 + d for d in tree.depths()])
        assert out["seeded_tree"] == greedy_path(chosen.tolist(), tree)


def test_a_seeded_draw_that_fails_ends_its_request_alone(monkeypatch):
    """The step's seeded parts draw together; where that pass fails, each draws alone, and the one whose draw fails
    ends with a fault at sampling while the other seeded request keeps the tokens it gets without it."""
    import smartspec.spec_decode.step_rows as step_rows

    seed = 7
    expected = accept_drafts(*a_step(seed)).tokens
    real, calls = step_rows.seeded_draws, []

    def failing_for_the_chain(probs, keys):  # the seeded chain alone reaches position 6 (the tree: 3, 4, 4, 5)
        calls.append(len(keys))
        if (seed, 6) in keys:
            raise RuntimeError("no noise at position 6")
        return real(probs, keys)

    monkeypatch.setattr(step_rows, "seeded_draws", failing_for_the_chain)
    got = accept_drafts(*a_step(seed))
    assert calls == [8, 4, 4]  # together, then each alone
    assert set(got.faults) == {"seeded"}
    assert got.faults["seeded"].stage == "sampling" and "no noise at position 6" in got.faults["seeded"].message
    assert got.tokens == {k: v for k, v in expected.items() if k != "seeded"}


def test_a_row_with_no_finite_logit_is_never_sampled_and_ends_its_request_alone():
    """A sampled request whose row is all -inf or NaN (the model's own logits here) is not handed to the
    sampler (which would raise, and stop every request of the step): it gets a fault naming why; the others in the
    step get the tokens they get without it."""
    for bad in (float("-inf"), float("nan")):
        items, logits, drafts = a_step(3)
        expected = accept_drafts(*a_step(3)).tokens
        logits[13] = bad  # the plain sampled request's one row
        logits[4:8] = bad  # the sampled chain's rows
        got = accept_drafts(items, logits, drafts)
        assert set(got.faults) == {"sampled", "plain_sampled"}
        assert all("logits at output token 0 are not finite" in f.message for f in got.faults.values())
        assert got.tokens == {k: v for k, v in expected.items() if k not in got.faults}


def test_a_dead_first_row_of_the_step_ends_its_request():
    """The step's very first row (row 0, the first request's) with no finite logit ends that request with its
    fault, as a dead row anywhere else does; the others keep their tokens."""
    for bad in (float("-inf"), float("nan")):
        items, logits, drafts = a_step(5)
        expected = accept_drafts(*a_step(5)).tokens
        logits[0] = bad  # the greedy chain's first row: whatever its draft, its output reaches it
        got = accept_drafts(items, logits, drafts)
        assert set(got.faults) == {"chain"}
        assert "logits at output token 0 are not finite" in got.faults["chain"].message
        assert got.tokens == {k: v for k, v in expected.items() if k != "chain"}


def test_a_dead_row_after_a_rejected_draft_is_never_reached():
    """A dead row the output does not reach (after a rejected draft token) ends nothing: plain decoding would
    never have computed it."""
    items, logits, drafts = a_step(4)
    expected = accept_drafts(*a_step(4)).tokens
    assert len(expected["chain"]) == 3  # drafts 4 and 7 accepted, 1 rejected: row 3 is never reached
    logits[3] = float("-inf")
    got = accept_drafts(items, logits, drafts)
    assert got.faults == {} and got.tokens == expected


class Copies(HostReads):
    """HostReads, and a count of the host values a stage sends to the device: the calls into runtime/upload.py
    (each one copy; what it makes a tensor there is its staging), while a value made a tensor anywhere else
    (torch.tensor, a tensor indexed by a Python list: lift_fresh outside it) is seen as a read is."""

    def __init__(self, monkeypatch):
        super().__init__()
        import sys

        import smartspec.runtime.upload as upload_module
        self.copies, self.inside = 0, False
        for name in ("upload", "upload_lists"):
            real = getattr(upload_module, name)

            def counted(*args, _real=real, **kwargs):
                outer, self.inside = not self.inside, True
                self.copies += outer  # upload_lists sends through upload: one copy
                try:
                    return _real(*args, **kwargs)
                finally:
                    self.inside = not outer
            for module in list(sys.modules.values()):  # wherever the engine imported it by name
                if getattr(module, "__name__", "").startswith("smartspec") and getattr(module, name, None) is real:
                    monkeypatch.setattr(module, name, counted)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.inside and func._schema.name.endswith("lift_fresh"):
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


def a_wide_step(copies: int):
    """`copies` of every kind of request: a_step's seven, and a chain with penalties, bias and min_tokens."""
    items, logits, drafts = [], [], {}
    controls = SamplingParams(temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.4,
                              logit_bias={3: 2.0}, min_tokens=9, stop_token_ids=[5])
    for c in range(copies):
        its, lg, dr = a_step(c)
        controlled = Request(f"controlled{c}", [1, 2, 3], controls)
        controlled.generator = torch.Generator().manual_seed(c)
        dr["controlled"] = Draft([4, 7, 2], None)
        its.append(ForwardItem(controlled, [0] * 4, 3, 4))
        lg = torch.cat([lg, torch.randn(4, V)])
        for it in its:
            it.request.request_id = f"{it.request.request_id}{c}"
        drafts.update({f"{rid}{c}": d for rid, d in dr.items()})
        items += its
        logits.append(lg)
    return items, torch.cat(logits), drafts


def test_a_step_sends_its_host_values_in_one_copy(monkeypatch):
    """Every host value the accept stage sends to the device crosses in runtime/upload.py (on a GPU: pinned, without
    blocking), in one copy a step however many requests it holds: the controlled rows with their controls' values,
    the sampled chains' drafts and the plain rows; nothing else makes a host value a tensor (torch.tensor, indexing
    by a list)."""
    counts = []
    for copies in (1, 3):
        items, logits, drafts = a_wide_step(copies)
        with Copies(monkeypatch) as sent:
            out = accept_drafts(items, logits, drafts).tokens
        monkeypatch.undo()
        assert sent.seen == [] and len(out) == 8 * copies
        counts.append(sent.copies)
    assert counts == [1, 1]


def test_a_steps_sampled_chains_and_plain_rows_made_together_equal_each_rule_alone():
    """Several unseeded sampled requests in one step, with top-k and top-p, chains with draft probabilities and
    without, and rows without drafts: their probabilities, verdicts and draws are made together
    (target_probs_rows, sampled_chains.py), and each request's tokens are those of its rule alone with its own
    generator."""
    g = torch.Generator().manual_seed(7)
    params = [SamplingParams(temperature=0.9, top_k=6), SamplingParams(temperature=0.7, top_p=0.8),
              SamplingParams(temperature=1.2, min_p=0.05), SamplingParams(temperature=0.8, top_k=4, top_p=0.9)]
    for seed in range(10):
        items, rows, drafts, alone = [], [], {}, {}
        for i in range(8):
            p = params[i % len(params)]
            k = 0 if i % 4 == 3 else 1 + (i + seed) % 4
            logits = torch.randn(k + 1, V, generator=g) * 2
            request = Request(f"r{i}", [1, 2, 3], p)
            request.generator = torch.Generator().manual_seed(100 * seed + i)
            items.append(ForwardItem(request, [0] * (k + 1), 3, k + 1))
            rows.append(logits)
            if k:
                tokens = [int(t) for t in torch.randint(0, V, (k,), generator=g)]
                for j, t in enumerate(tokens[:2]):
                    logits[j, t] += 3.0  # some drafts accepted
                q = torch.softmax(torch.randn(k, V, generator=g), -1) if i % 2 else None
                drafts[request.request_id] = Draft(tokens, q)
            alone[request.request_id] = (logits, p, torch.Generator().manual_seed(100 * seed + i))
        out = accept_drafts(items, torch.cat(rows), drafts).tokens
        for rid, (logits, p, generator) in alone.items():
            if rid in drafts:
                expected = accept_sampled(target_probs(logits, p), drafts[rid].tokens, drafts[rid].probs, generator)
            else:
                expected = [int(torch.multinomial(target_probs(logits[0], p), 1, generator=generator))]
            assert out[rid] == expected, rid


def test_controlled_rows_whose_staging_fails_are_reshaped_alone_to_the_same_tokens(monkeypatch):
    """Where the controls' values cannot be staged with the step's others, each controlled request is reshaped alone
    and the rows' places are made on the device: every request gets the tokens it gets when staging works."""
    import smartspec.spec_decode.controlled as controlled_module

    items, logits, drafts = a_wide_step(2)
    again, _, drafts_again = a_wide_step(2)  # the same requests with fresh generators (the logits: the first's)
    biased = SamplingParams(logit_bias={3: 50.0}, repetition_penalty=1.2)  # greedy: its tokens are its rows' argmax
    for its, dr in ((items, drafts), (again, drafts_again)):
        its.append(ForwardItem(Request("biased", [1, 2, 3], biased), [0] * 3, 3, 3))
        dr["biased"] = Draft([3, 3], None)
    logits = torch.cat([logits, torch.randn(3, V, generator=torch.Generator().manual_seed(9))])
    expected = accept_drafts(items, logits, drafts).tokens
    assert expected["biased"] == [3, 3, 3]

    def failing(*args, **kwargs):
        raise RuntimeError("no staging")
    monkeypatch.setattr(controlled_module, "StagedControls", failing)
    got = accept_drafts(again, logits, drafts_again)
    assert got.faults == {} and got.tokens == expected
