"""Penalized requests' histories kept on the device between steps (runtime/token_counts.py): after every update each
row holds exactly its request's whole history, counted afresh, whatever happened between (requests ending and
their rows taken again, ids used again, updates staged and never run, updates that failed); and what a step sends
for a request is only what came since its last step."""
import random

import pytest
import torch

from smartspec import SamplingParams
from smartspec.runtime.logits_controls import ControlledRows, StagedControls, reshape_rows, reshape_staged
from smartspec.runtime.token_counts import CountRequest, TokenCounts
from smartspec.runtime.upload import HostBatch

V = 40
CPU = torch.device("cpu")


def counted_afresh(prompt: list[int], output: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    counts, marks = torch.zeros(V + 1), torch.zeros(V + 1, dtype=torch.bool)
    for tok in output:
        counts[min(tok, V)] += 1
    for tok in prompt:
        marks[min(tok, V)] = True
    return counts, marks


def update(kept: TokenCounts, requests: list[CountRequest]):
    batch = HostBatch()
    staged = kept.stage(requests, V, CPU, batch)
    return staged, kept.apply(staged, batch.send(CPU))


def test_each_row_is_its_whole_history_through_a_random_life_of_requests():
    """Random steps over requests that grow, end (rows released and taken again), come back under an id used
    before with another prompt (unreleased), are staged and never applied, or whose update fails: after each update
    every staged row equals its history counted afresh. Fails if rows were not cleared when taken again, if an
    unapplied or failed update were trusted, or if a reused id kept the old request's counts."""
    rng = random.Random(0)
    kept = TokenCounts()
    live: dict[str, tuple[list[int], list[int]]] = {}
    checked = 0
    for step in range(400):
        while len(live) < 6:
            key = f"r{rng.randrange(12)}"  # ids come back
            live[key] = ([rng.randrange(V + 3) for _ in range(rng.randrange(1, 6))], [])
        for prompt, output in live.values():
            output.extend(rng.randrange(V + 3) for _ in range(rng.randrange(0, 5)))
        keys = rng.sample(sorted(live), rng.randrange(1, len(live) + 1))
        requests = [CountRequest(k, live[k][0], list(live[k][1]), True) for k in keys]
        fate = rng.random()
        if fate < 0.1:  # staged, never applied (the stage failed after staging)
            kept.stage(requests, V, CPU, HostBatch())
        elif fate < 0.2:  # the update fails as it runs: at the new tokens, or at the prompts after counting them
            batch = HostBatch()
            staged = kept.stage(requests, V, CPU, batch)
            sent = batch.send(CPU)
            broken = staged.counted if fate < 0.15 else staged.prompted
            sent[broken[0]], sent[broken[1]] = torch.tensor([10 ** 6]), torch.tensor([0])
            with pytest.raises(IndexError):
                kept.apply(staged, sent)
        else:
            staged, (output, marks) = update(kept, requests)
            for r, slot in zip(requests, staged.slots):
                want_counts, want_marks = counted_afresh(r.prompt, r.output)
                assert torch.equal(output[slot], want_counts) and torch.equal(marks[slot], want_marks), (step, r.key)
                checked += 1
        for key in list(live):
            if rng.random() < 0.08:
                del live[key]
                if rng.random() < 0.7:  # the others end unreleased; their ids may come back
                    kept.release(key)
    assert checked > 500


def test_kept_counts_reshape_every_step_as_the_whole_history_does():
    """The accept stage's rows, reshaped with counts kept across steps (keyed by request), equal bitwise the rows
    reshaped from the whole history each step, over requests with every penalty, drafts before rows, a request
    without penalties in the batch and tokens past V."""
    rng = random.Random(1)
    params = [SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=-0.2),
              SamplingParams(frequency_penalty=1.1, logit_bias={2: 3.0}), SamplingParams(logit_bias={5: -1.0}),
              SamplingParams(repetition_penalty=0.8, min_tokens=30, stop_token_ids=[1])]
    prompts = [[rng.randrange(V + 2) for _ in range(7)] for _ in params]
    outputs: list[list[int]] = [[] for _ in params]
    kept = TokenCounts()
    for step in range(30):
        requests = []
        for i, p in enumerate(params):
            outputs[i].extend(rng.randrange(V + 2) for _ in range(rng.randrange(1, 4)))
            draft = [rng.randrange(V + 2) for _ in range(3)]
            requests.append(ControlledRows(p, prompts[i], list(outputs[i]), [draft[:j] for j in range(4)], f"q{i}"))
        logits = torch.randn(16, V, generator=torch.Generator().manual_seed(step))
        batch = HostBatch()
        staged = StagedControls(requests, [0], V, None, batch, CPU, kept)
        assert torch.equal(reshape_staged(logits, staged, batch.send(CPU)), reshape_rows(logits, requests, [0])), step


def test_a_step_sends_only_the_tokens_since_its_last():
    """What a penalized request's step sends does not grow with its history: after its first step, only the
    tokens it gained since (its prompt once). Fails if the whole history went each step."""
    kept, prompt, output, sizes = TokenCounts(), list(range(30)), list(range(500)), []
    p = SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5)
    for _ in range(3):
        output += [7, 8]
        batch = HostBatch()
        staged = StagedControls([ControlledRows(p, prompt, list(output), [[]], "a")], [], V, None, batch, CPU, kept)
        sizes.append(sum(len(values) for values in batch._values))
        reshape_staged(torch.zeros(1, V), staged, batch.send(CPU))
    assert sizes[0] >= 2 * (len(prompt) + 502) and all(size < 20 for size in sizes[1:]), sizes
