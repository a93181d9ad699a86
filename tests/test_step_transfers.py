"""An engine step's host values cross to the device in one copy a stage: the forward's inputs, the accept stage's
(the controls' values, the grammars' masks, the sampled chains' drafts, the plain rows) and, where a request asks
for logprobs, their rows; however many requests the step holds and whatever they ask for. A draft model adds its
own forward's copy at each depth it drafts. Counted at every copy point (tests/transfers.py), none exempt. The
other way, a step reads the host twice at most: its tokens, and its logprobs."""
import pytest
from engines import PROMPTS, make
from transfers import Transfers

from smartspec import SamplingParams
from smartspec.types.sampling_params import StructuredOutput


def every_kind(seed: int) -> list[SamplingParams]:
    """Greedy, sampled, seeded, with penalties, bias and min_tokens, structured, and asking for logprobs."""
    return [SamplingParams(max_tokens=10, ignore_eos=True),
            SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.9),
            SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8, seed=seed),
            SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.7, presence_penalty=0.5,
                           repetition_penalty=1.2, logit_bias={3: 2.0}, min_tokens=6),
            SamplingParams(max_tokens=10, structured=StructuredOutput(regex="[a-z ]{1,40}")),
            SamplingParams(max_tokens=10, ignore_eos=True, logprobs=2)]


def copies_per_step(engine, copies: int, monkeypatch) -> list[list[str]]:
    """`copies` requests of every kind decoded to their end; each step's transfers."""
    for c in range(copies):
        for j, params in enumerate(every_kind(c)):
            engine.add_request(PROMPTS[j % len(PROMPTS)], params, request_id=f"{c}-{j}")
    steps = []
    while engine.has_unfinished():
        transfers = Transfers(monkeypatch)
        engine.step()
        monkeypatch.undo()
        steps.append(transfers.seen)
    assert engine.speculation.metrics.num_draft_tokens > 0  # chains were verified, sampled ones among them
    assert all(set(seen) <= {"upload"} for seen in steps), steps
    return steps


@pytest.mark.parametrize("copies", [1, 3])
def test_a_step_sends_one_copy_a_stage_whatever_it_holds(tiny_qwen, copies, monkeypatch):
    engine = make(tiny_qwen, {"method": "ngram", "num_speculative_tokens": 3, "policy": "fixed"}).engine
    steps = copies_per_step(engine, copies, monkeypatch)
    # the forward's, the accept stage's, the logprobs': no more in any step, and in the steps where all run, all three
    assert max(map(len, steps)) == 3, steps


def test_a_draft_models_steps_send_as_many_copies_whatever_they_hold(tiny_qwen, tiny_qwen_draft, monkeypatch):
    """A draft model's forward at each depth sends its inputs (and its controlled rows' values) in copies of its
    own: a fixed number a step, the same at one and at three requests of every kind."""
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "policy": "fixed", "model": tiny_qwen_draft}
    most = [max(map(len, copies_per_step(make(tiny_qwen, spec).engine, copies, monkeypatch))) for copies in (1, 3)]
    assert most[0] == most[1] > 3, most


@pytest.mark.parametrize("drafts", ["chain", "tree"])
def test_a_step_reads_the_host_twice_at_most_whatever_it_holds(tiny_qwen, drafts, monkeypatch):
    """Back from the device, a step of every kind of request (sampled chains or token trees among them) reads its
    tokens once and, where a request asks for logprobs, their values once: no other read, none inside an operation
    (torch.multinomial's checks, `.item()`; tests/host_reads.py), none a level of a sampled tree."""
    import torch
    from host_reads import HostReads

    spec = {"method": "ngram", "num_speculative_tokens": 3, "policy": "fixed"}
    if drafts == "tree":
        spec = {**spec, "num_speculative_tokens": 4, "tree": {"max_nodes": 4, "max_depth": 3, "branching": 2}}
    engine = make(tiny_qwen, spec).engine
    for c in range(2):
        for j, params in enumerate(every_kind(c)):
            engine.add_request(PROMPTS[j % len(PROMPTS)], params, request_id=f"{c}-{j}")
    reads, original = [], torch.Tensor.tolist

    def counted(self):
        reads[-1] += 1
        return original(self)
    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    while engine.has_unfinished():
        reads.append(0)
        with HostReads() as inside:
            engine.step()
        assert [op for op in inside.seen if op != "lift_fresh"] == []  # lift_fresh: host values made tensors
    assert max(reads) == 2 and engine.speculation.metrics.num_draft_tokens > 0, reads
