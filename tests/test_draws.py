"""Sampled tokens without host reads (runtime/sampler.py draw, draw_rows, draw_tokens): torch.multinomial's own
draws, the same tokens and the same generator states on a CPU, without its two host reads a call (each a wait for a
GPU); rows that share a generator drawn together; a failing row its own."""
import pytest
import torch
from host_reads import HostReads
from torch.utils._python_dispatch import TorchDispatchMode

from smartspec.runtime import sampler
from smartspec.runtime.sampler import draw, draw_rows, draw_tokens, uniforms
from smartspec.types.sampling_params import SamplingParams

V = 211


def some_probs(rows: int, seed: int) -> torch.Tensor:
    """Distributions with tokens of probability 0 (a top-k's or a grammar's), a one-hot row among them."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, V, generator=g) * 3
    logits[logits < -2] = float("-inf")
    logits[0, :] = float("-inf")
    logits[0, 5] = 0.0
    return torch.softmax(logits, dim=-1)


class Draws(TorchDispatchMode):
    """Counts the random draws of one kind (exponential_: races; rand: uniforms) made while active."""

    def __init__(self, kind: str = "exponential_"):
        super().__init__()
        self.kind, self.count = kind, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func._schema.name.endswith(self.kind)
        return func(*args, **(kwargs or {}))


def test_a_draw_is_multinomials_draw_and_reads_nothing_back():
    for seed in range(20):
        probs = some_probs(6, seed)
        for block in (probs, probs[3]):  # rows, and a single row
            ours, theirs = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
            with HostReads() as ours_read:
                drawn = draw(block, ours)
            with HostReads() as theirs_read:
                expected = torch.multinomial(block, 1, generator=theirs)
            assert torch.equal(drawn, expected) and drawn.shape == expected.shape
            assert torch.equal(ours.get_state(), theirs.get_state())
            assert ours_read.seen == [] and theirs_read.seen == ["multinomial"]  # the detector sees what it must
            assert bool((block.gather(-1, drawn) > 0).all())


def test_rows_sharing_a_generator_are_drawn_together_as_a_row_at_a_time():
    probs = some_probs(7, 3)
    shared, other = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    generators = [shared, shared, other, shared, shared, shared, other]
    with HostReads() as reads, Draws() as races:
        drawn = draw_rows(probs, generators)
    assert races.count == 4  # a race a run of rows sharing a generator: [0, 1], [2], [3, 4, 5], [6]
    again = {id(shared): torch.Generator().manual_seed(1), id(other): torch.Generator().manual_seed(2)}
    expected = [int(torch.multinomial(probs[i], 1, generator=again[id(g)])) for i, g in enumerate(generators)]
    assert drawn.tolist() == expected and reads.seen == []
    assert torch.equal(shared.get_state(), again[id(shared)].get_state())


def test_a_zero_in_the_race_never_draws_a_token_of_probability_zero(monkeypatch):
    """An exponential draw of exactly 0 (p / 0: NaN where p = 0, which argmax takes) counts as the smallest
    float: the row's token is then one it gives probability."""
    probs = some_probs(4, 9)
    monkeypatch.setattr(torch.Tensor, "exponential_", lambda self, *a, **k: self.zero_())
    drawn = draw(probs, torch.Generator().manual_seed(0))
    assert bool((probs.gather(-1, drawn) > 0).all())
    assert drawn.view(-1).tolist() == probs.argmax(dim=-1).tolist()


def test_a_row_whose_probabilities_or_draw_fail_keeps_its_argmax_and_is_returned_alone(monkeypatch):
    """draw_tokens: greedy rows keep their argmax; a row whose controls raise keeps it and is returned with its
    exception; where a run's draw together raises, its rows are drawn one at a time, a row that raises there
    returned as well; every other row is the draw it gets alone."""
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(4))
    best = logits.argmax(dim=-1)
    params = [SamplingParams(), SamplingParams(temperature=0.8), SamplingParams(temperature=0.9),
              SamplingParams(temperature=0.7, top_k=9), SamplingParams(temperature=1.3), SamplingParams()]
    real_probs, real_draw = sampler.target_probs, sampler.draw

    def failing_probs(row, p):
        if p.temperature == 0.9:
            raise RuntimeError("controls of row 2")
        return real_probs(row, p)

    def failing_draw(probs, generator=None):
        if probs.dim() == 2 and len(probs) > 1:
            raise RuntimeError("the run together")
        if probs[0].item() == row_4_first:
            raise RuntimeError("row 4 alone")
        return real_draw(probs, generator)

    row_4_first = float(real_probs(logits[4], params[4])[0])
    monkeypatch.setattr(sampler, "target_probs", failing_probs)
    monkeypatch.setattr(sampler, "draw", failing_draw)
    shared = torch.Generator().manual_seed(6)
    tokens, failed = draw_tokens(logits, best, params, [None, shared, shared, shared, shared, None])
    assert set(failed) == {2, 4} and "row 2" in str(failed[2]) and "row 4 alone" in str(failed[4])
    again = torch.Generator().manual_seed(6)
    expected = [int(torch.multinomial(real_probs(logits[row], params[row]), 1, generator=again)) for row in (1, 3)]
    assert tokens.tolist() == [int(best[0]), expected[0], int(best[2]), expected[1], int(best[4]), int(best[5])]


@pytest.mark.parametrize("with_probs", [True, False])
def test_draw_tokens_draws_what_each_row_draws_alone(with_probs):
    """Rows of several generators and greedy rows interleaved, probabilities made together or each alone: every
    sampled row's token the one multinomial gives it with its generator, in order; nothing read back."""
    logits = torch.randn(9, V, generator=torch.Generator().manual_seed(8))
    best = logits.argmax(dim=-1)
    params = [SamplingParams(temperature=0.5 + 0.1 * i, top_p=0.9) if i % 3 else SamplingParams() for i in range(9)]
    seeds = [None if p.greedy else i % 2 for i, p in enumerate(params)]
    made = {0: torch.Generator().manual_seed(10), 1: torch.Generator().manual_seed(11)}
    generators = [None if s is None else made[s] for s in seeds]
    probs = torch.stack([sampler.target_probs(logits[i], p) for i, p in enumerate(params)]) if with_probs else None
    with HostReads() as reads:
        tokens, failed = draw_tokens(logits, best, params, generators, probs)
    alone = {0: torch.Generator().manual_seed(10), 1: torch.Generator().manual_seed(11)}
    expected = [int(best[i]) if s is None else
                int(torch.multinomial(sampler.target_probs(logits[i], params[i]), 1, generator=alone[s]))
                for i, s in enumerate(seeds)]
    assert failed == {} and tokens.tolist() == expected and reads.seen == []


def test_uniforms_of_rows_sharing_a_generator_are_drawn_together_as_a_row_at_a_time():
    shared, other = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    counts, generators = [3, 1, 4, 2, 5], [shared, shared, other, shared, shared]
    with Draws("rand") as draws:
        got = uniforms(counts, generators, torch.device("cpu"))
    assert draws.count == 3  # [0, 1], [2], [3, 4]
    again = {id(shared): torch.Generator().manual_seed(1), id(other): torch.Generator().manual_seed(2)}
    expected = torch.cat([torch.rand(n, generator=again[id(g)]) for n, g in zip(counts, generators)])
    assert torch.equal(got, expected)
