"""An engine step's host values cross to the device in one copy a stage: the forward's inputs, the accept stage's
(the controls' values, the grammars' masks, the sampled chains' drafts, the plain rows) and, where a request asks
for logprobs, their rows; however many requests the step holds and whatever they ask for. Counted at every copy
point (tests/transfers.py), none exempt."""
import pytest
from engines import PROMPTS, make
from transfers import Transfers

from smartspec import SamplingParams
from smartspec.types.sampling_params import StructuredOutput

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "policy": "fixed"}


def every_kind(seed: int) -> list[SamplingParams]:
    """Greedy, sampled, seeded, with penalties, bias and min_tokens, structured, and asking for logprobs."""
    return [SamplingParams(max_tokens=10, ignore_eos=True),
            SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.9),
            SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8, seed=seed),
            SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.7, presence_penalty=0.5,
                           repetition_penalty=1.2, logit_bias={3: 2.0}, min_tokens=6),
            SamplingParams(max_tokens=10, structured=StructuredOutput(regex="[a-z ]{1,40}")),
            SamplingParams(max_tokens=10, ignore_eos=True, logprobs=2)]


@pytest.mark.parametrize("copies", [1, 3])
def test_a_step_sends_one_copy_a_stage_whatever_it_holds(tiny_qwen, copies, monkeypatch):
    engine = make(tiny_qwen, SPEC).engine
    for c in range(copies):
        for j, params in enumerate(every_kind(c)):
            engine.add_request(PROMPTS[j % len(PROMPTS)], params, request_id=f"{c}-{j}")
    steps = []
    while engine.has_unfinished():
        transfers = Transfers(monkeypatch)
        engine.step()
        monkeypatch.undo()
        steps.append(transfers.seen)
    drafted = engine.speculation.metrics.num_draft_tokens
    assert drafted > 0  # chains were verified, sampled ones among them
    assert all(set(seen) <= {"upload"} for seen in steps), steps
    # the forward's, the accept stage's, the logprobs': no more in any step, and in the steps where all run, all three
    assert max(map(len, steps)) == 3, steps
