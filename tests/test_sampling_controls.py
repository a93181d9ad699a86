"""Penalties, logit_bias, min_p and min_tokens: each does what its definition says (checked against transformers'
own logits processors where it has them), and speculation stays lossless with them: greedy output equals plain
output token for token, and sampled speculation follows the reshaped target distribution (chi-square)."""
import math
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor
from engines import METHODS, PROMPTS, make, mixed_spec, run_staggered

from smartspec import SamplingParams
from smartspec.runtime.logits_controls import ControlledRows, reshape_rows
from smartspec.runtime.sampler import target_probs

V = 50


def reshape_logits(logits, params, prompt, output, prefixes, eos_token_ids=()):
    """One request's rows reshaped (row i after prompt + output + prefixes[i]): reshape_rows with that request."""
    return reshape_rows(logits, [ControlledRows(params, prompt, output, prefixes)], eos_token_ids)


def test_repetition_penalty_matches_transformers():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, V, generator=g) * 3
    prompt, output = [1, 2, 3, 3], [7, 2, 9]
    ours = reshape_logits(logits, SamplingParams(repetition_penalty=1.7), prompt, output, [[]])
    theirs = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + output]), logits.clone())
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_min_p_matches_transformers():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, V, generator=g) * 3
    params = SamplingParams(temperature=0.8, min_p=0.1)
    theirs = torch.softmax(MinPLogitsWarper(0.1)(None, logits / 0.8), dim=-1)
    torch.testing.assert_close(target_probs(logits, params), theirs)


def test_presence_frequency_bias_and_min_tokens_by_their_definitions():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, V, generator=g)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, logit_bias={4: 10.0, 5: -100.0},
                            min_tokens=3, stop_token_ids=[11])
    out = reshape_logits(logits, params, [1, 2], [7, 7], [[], [8]], eos_token_ids=[49])
    expected = logits.clone()
    expected[:, 7] -= 0.5 + 2 * 0.25  # in the output twice; prompt tokens carry no presence/frequency penalty
    expected[1, 8] -= 0.5 + 0.25  # row 1 follows the draft token 8
    expected[:, 4] += 10.0
    expected[:, 5] -= 100.0
    expected[0, [11, 49]] = float("-inf")  # row 0 is the 3rd token: too early to end; row 1 is the 4th
    torch.testing.assert_close(out, expected)


def test_a_verified_row_is_bitwise_the_row_plain_decoding_reshapes():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, V, generator=g) * 2
    params = SamplingParams(presence_penalty=0.3, frequency_penalty=0.7, repetition_penalty=1.3, min_tokens=4)
    prompt, output, draft = [3, 4], [5, 6], [6, 9, 3]
    chain = reshape_logits(logits, params, prompt, output, [draft[:j] for j in range(4)], eos_token_ids=[0])
    for j in range(4):
        one = reshape_logits(logits[j:j + 1], params, prompt, output + draft[:j], [[]], eos_token_ids=[0])
        assert torch.equal(chain[j], one[0]), j
    # the test can fail: without the draft prefix, rows after a repeated draft token differ
    wrong = reshape_logits(logits, params, prompt, output, [[]] * 4, eos_token_ids=[0])
    assert not torch.equal(wrong[2], chain[2])


def test_a_batch_of_requests_reshapes_each_row_bitwise_as_alone():
    """reshape_rows over requests with different controls (and one without any) gives each request's rows bitwise
    what reshaping it alone gives; a request without controls comes out exactly as it went in (-0.0 included)."""
    g = torch.Generator().manual_seed(4)
    controls = [SamplingParams(repetition_penalty=1.4, frequency_penalty=-0.7),
                SamplingParams(),
                SamplingParams(presence_penalty=0.9, logit_bias={3: 4.0, 60: 1.0}, min_tokens=3, stop_token_ids=[9]),
                SamplingParams(frequency_penalty=1.1, logit_bias={5: -2.5})]
    rows = [ControlledRows(p, [3, 1, 3, 70], [5, 5, 2 + i, 64], [d[:j] for j in range(3)])
            for i, (p, d) in enumerate(zip(controls, [[5, 9], [1, 1], [3, 3], [2, 77]]))]
    logits = torch.randn(12, V, generator=g) * 2
    logits[3:6, 7] = -0.0
    batch = reshape_rows(logits, rows, eos_token_ids=[0])
    for i, r in enumerate(rows):
        alone = reshape_logits(logits[3 * i:3 * i + 3], r.params, r.prompt, r.output, r.prefixes, eos_token_ids=[0])
        assert torch.equal(batch[3 * i:3 * i + 3], alone), i
    assert torch.equal(batch[3:6], logits[3:6]) and batch[3, 7].signbit()
    assert not torch.equal(batch[0:3], logits[0:3])  # the test can fail: the controls did reshape


def test_tokens_past_the_rows_vocabulary_are_left_out_and_nothing_is_read_back():
    """A draft's logits may be narrower than the target's vocabulary: history, bias and ends past V change nothing
    (as if they were not there), and reshaping reads nothing back from the device (on a GPU: no wait)."""
    from host_reads import HostReads

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, V, generator=g)
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, logit_bias={3: 1.0, V + 4: 9.0},
                            min_tokens=7, stop_token_ids=[7, V + 1])
    with HostReads() as syncs:
        wide = reshape_logits(logits, params, [1, V + 2], [4, V + 3, 4], [[], [V + 9, 6]], eos_token_ids=[V + 5])
    assert [op for op in syncs.seen if op != "lift_fresh"] == []  # lift_fresh: the lists made tensors on the host
    narrow = reshape_logits(logits, SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5,
                                                   logit_bias={3: 1.0}, min_tokens=7, stop_token_ids=[7]),
                            [1], [4, 4], [[], [6]])
    assert torch.equal(wide, narrow) and not torch.equal(narrow, logits)


@pytest.mark.parametrize("bad", [dict(presence_penalty=3), dict(frequency_penalty=-2.5), dict(repetition_penalty=0),
                                 dict(min_p=1.5), dict(min_tokens=-1), dict(min_tokens=100, max_tokens=10),
                                 dict(logit_bias={-1: 1.0}), dict(logit_bias={3: 101})])
def test_bad_controls_are_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


CONTROLS = [dict(repetition_penalty=1.8), dict(presence_penalty=1.5, frequency_penalty=1.0),
            dict(logit_bias={70: 6.0, 71: -100}, min_tokens=10, min_p=0.2)]


@pytest.fixture(scope="module")
def plain_controlled(tiny_qwen):
    return {i: [o.token_ids for o in make(tiny_qwen).generate(PROMPTS, controlled(c))]
            for i, c in enumerate(CONTROLS)}


def controlled(controls: dict) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=n, **controls) for n in (40, 25, 33, 12)]


@pytest.mark.parametrize("index", range(len(CONTROLS)))
@pytest.mark.parametrize("method", METHODS)
def test_greedy_speculation_with_controls_equals_plain(method, index, tiny_qwen, tiny_qwen_draft, plain_controlled):
    llm = make(tiny_qwen, mixed_spec(method, tiny_qwen, tiny_qwen_draft))
    assert run_staggered(llm, PROMPTS, controlled(CONTROLS[index])) == plain_controlled[index]
    m = llm.engine.speculation.metrics
    if method.startswith("self"):
        assert m.accepted_per_position[1] > 0 and m.accepted_per_position[2] > 0, m


def test_controls_change_the_output(tiny_qwen, plain_controlled):
    plain = [o.token_ids for o in make(tiny_qwen).generate(PROMPTS, controlled({}))]
    for i in range(len(CONTROLS)):
        assert plain_controlled[i] != plain, CONTROLS[i]


def test_min_tokens_holds_back_the_end_and_a_bias_forces_it_after(tiny_qwen):
    llm = make(tiny_qwen)
    eos = llm.engine.tokenizer.eos_token_id
    out = llm.generate(["hello"], SamplingParams(max_tokens=30, min_tokens=6, logit_bias={eos: 100.0}))[0]
    assert len(out.token_ids) == 7 and out.token_ids[-1] == eos and out.finish_reason == "stop"


def test_logit_bias_outside_the_vocabulary_is_refused(tiny_qwen):
    llm = make(tiny_qwen)
    with pytest.raises(ValueError, match="logit_bias names token id 100000"):
        llm.engine.add_request("hi", SamplingParams(logit_bias={100000: 1.0}))


def chi2_critical(dof: int, z: float = 3.719) -> float:
    """The chi-square critical value at alpha = 1e-4 (z: that normal quantile), by Wilson and Hilferty's
    approximation (within 1% of the exact value from 5 degrees of freedom up)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


# the bias concentrates the draws on three tokens and the penalties move them away from the ones drawn: which
# token the 2nd was changes the 3rd's distribution a lot (reshaping without it is 0.23 away in total variation)
SAMPLED = SamplingParams(max_tokens=6, temperature=1.0, top_k=3, presence_penalty=1.0, frequency_penalty=1.0,
                         logit_bias={70: 8.0, 71: 8.0, 72: 8.0}, ignore_eos=True)


def reference_joint(path: str, prompt: list[int], params: SamplingParams, depth: int) -> dict[tuple, float]:
    """The exact probability of every first-`depth`-token sequence under the reshaped target, by transformers."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    joint = {(): 1.0}
    with torch.no_grad():
        for _ in range(depth):
            nxt = {}
            for seq, p_seq in joint.items():
                logits = model(torch.tensor([prompt + list(seq)])).logits[0, -1:]
                probs = target_probs(reshape_logits(logits, params, prompt, list(seq), [[]]), params)[0]
                for tok in torch.nonzero(probs).flatten().tolist():
                    nxt[seq + (tok,)] = p_seq * float(probs[tok])
            joint = nxt
    return joint


def test_sampled_speculation_with_penalties_follows_the_reshaped_target(tiny_qwen, tiny_qwen_draft):
    """The first three tokens' joint distribution: the 2nd and 3rd come from one verify step (k = 2), so the 3rd's
    row is reshaped with the draft token before it. 3,000 seeded requests, against the exact joint."""
    llm = make(tiny_qwen, {"method": "draft_model", "model": tiny_qwen_draft, "num_speculative_tokens": 2,
                           "policy": "fixed"}, max_num_seqs=256)
    prompt = llm.engine.tokenize("abcabc")
    n = 3000
    outs = llm.generate([prompt] * n, [SamplingParams(**{**SAMPLED.__dict__, "seed": s}) for s in range(n)])
    m = llm.engine.speculation.metrics
    assert m.num_draft_tokens > n and 0 < m.num_accepted_tokens < m.num_draft_tokens, m
    got = Counter(tuple(o.token_ids[:3]) for o in outs)
    expected = reference_joint(tiny_qwen, prompt, SAMPLED, 3)
    assert set(got) <= set(expected), set(got) - set(expected)
    # cells expected fewer than 5 times are pooled into one, as the chi-square approximation needs
    small = [s for s, p in expected.items() if p * n < 5]
    cells = [([s], p) for s, p in expected.items() if p * n >= 5] + \
        ([(small, sum(expected[s] for s in small))] if small else [])
    stat = sum((sum(got[s] for s in seqs) - p * n) ** 2 / (p * n) for seqs, p in cells)
    assert stat < chi2_critical(len(cells) - 1), (stat, len(cells), got.most_common(8))
    assert not math.isnan(stat)


def test_a_temperature_too_small_to_divide_by_decodes_greedily(tiny_qwen, tiny_qwen_draft):
    """A temperature of 1e-136 divides logits to inf (the softmax to NaN, and the engine stopped). Below
    GREEDY_BELOW it decodes greedily, plainly and under speculation, equal to temperature 0."""
    from smartspec.types.sampling_params import GREEDY_BELOW

    temperatures = (2.6e-136, 1e-30, GREEDY_BELOW / 2, 0.0)
    tiny = [SamplingParams(max_tokens=12, ignore_eos=True, temperature=t, repetition_penalty=2.0, min_p=0.12)
            for t in temperatures]
    assert all(p.greedy for p in tiny) and not SamplingParams(temperature=GREEDY_BELOW).greedy
    zero = [SamplingParams(**{**p.__dict__, "temperature": 0.0}) for p in tiny]
    reference = [o.token_ids for o in make(tiny_qwen).generate(PROMPTS, zero)]
    for spec in (None, mixed_spec("draft_model", tiny_qwen, tiny_qwen_draft)):
        assert [o.token_ids for o in make(tiny_qwen, spec).generate(PROMPTS, tiny)] == reference
