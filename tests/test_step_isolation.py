"""Step isolation: a fault inside one request's part of a step (its logits controls, grammar, sampling, acceptance,
commit, detokenizing, logprobs or output) ends that request alone, with finish reason "error" and a message naming
the stage; its KV goes back, and every bystander in the same batch gets exactly the tokens it gets in a run without
the fault. A forward that fails is retried once without speculation; a second failure ends that step's requests
and no later one."""
import pytest
from engines import make

import smartspec.engine.commit as commit_module
import smartspec.engine.llm_engine as engine_module
import smartspec.runtime.logits_controls as logits_controls_module
import smartspec.runtime.sampler as sampler_module
import smartspec.spec_decode.step_rows as step_rows_module
import smartspec.spec_decode.controlled as controlled_module
from smartspec import SamplingParams
from smartspec.structured.matcher import RequestGrammar
from smartspec.types.sampling_params import StructuredOutput

PROMPTS = ["abcabcabcabc abc", "def f(x): return x\ndef g(x): return x\ndef", "xyz " * 8, "hello world"]
SPEC = {"method": "ngram", "num_speculative_tokens": 3}
VICTIM = "victim"


def bystanders() -> list[SamplingParams]:
    """Greedy, seeded sampled, with penalties and with a grammar: what shares a batch with the victim."""
    return [SamplingParams(max_tokens=14, ignore_eos=True),
            SamplingParams(max_tokens=14, ignore_eos=True, temperature=0.9, seed=11),
            SamplingParams(max_tokens=14, ignore_eos=True, presence_penalty=0.5, logit_bias={3: 2.0}),
            SamplingParams(max_tokens=14, structured=StructuredOutput(regex="[a-z ]{1,40}"))]


def victim_params(seed: int | None = None) -> SamplingParams:
    """Sampled, with penalties, logprobs and a grammar: it passes through every stage (seeded, its tokens are
    verified as drafts are, whether it has drafts or not)."""
    return SamplingParams(max_tokens=14, ignore_eos=True, temperature=0.8, presence_penalty=0.3, logprobs=2,
                          seed=seed, structured=StructuredOutput(regex="[a-z ]{20,40}"))


def run(llm, with_victim: bool, victim_seed: int | None = None) -> dict[str, object]:
    """The bystanders (and the victim) in one batch, stepped to the end; the finished outputs by request id."""
    engine = llm.engine
    for i, (prompt, params) in enumerate(zip(PROMPTS, bystanders())):
        engine.add_request(prompt, params, request_id=f"b{i}")
    if with_victim:
        engine.add_request("zzz yyy zzz", victim_params(victim_seed), request_id=VICTIM)
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


@pytest.fixture(scope="module")
def llm(tiny_qwen):
    return make(tiny_qwen, SPEC)


@pytest.fixture(scope="module")
def clean(llm):
    """The bystanders' outputs beside a victim that does not fail."""
    return run(llm, with_victim=True)


def failing_for_victim(real, find_request, after: int = 2):
    """real, raising for the victim's request from its (after + 1)-th call on."""
    calls = [0]

    def wrapped(*args, **kwargs):
        req = find_request(*args, **kwargs)
        if req is not None and req.request_id == VICTIM:
            calls[0] += 1
            if calls[0] > after:
                raise RuntimeError("injected fault")
        return real(*args, **kwargs)
    return wrapped


class GrammarOf:
    """Finds the request a grammar belongs to (grammars are per request; the engine keeps them by id)."""

    def __init__(self, engine):
        self.engine = engine

    def __call__(self, grammar, *args):
        rid = next((r for r, g in self.engine.grammars.items() if g is grammar), None)
        return self.engine.requests.get(rid)


def params_owner(engine):
    """Finds the request whose params a call was given (target_probs takes them second)."""
    def find(logits, params, *args):
        return next((r for r in engine.requests.values() if r.params is params), None)
    return find


def row_params_owner(engine):
    """Finds the victim among the requests whose rows a batched sampling pass was given (target_probs_rows: rows,
    their controls, with each row's params), or one of the others."""
    def find(rows, controls, *args):
        given = [r for r in engine.requests.values() if any(p is r.params for p in controls.params)]
        return next((r for r in given if r.request_id == VICTIM), given[0] if given else None)
    return find


def rows_owner(engine):
    """Finds the victim among the requests whose rows a reshape was given (reshape_staged: logits, the staged
    controls of the requests' rows: the step's batched pass, or one request's alone through reshape_rows), or one of
    the others."""
    def find(logits, staged, *args):
        given = [r for r in engine.requests.values() if any(c.params is r.params for c in staged.requests)]
        return next((r for r in given if r.request_id == VICTIM), given[0] if given else None)
    return find


# stage -> the places a fault is injected: (module or class, attribute, how the request is found among the call's
# arguments)
FAULTS = {
    "logits controls": [(controlled_module, "reshape_staged", rows_owner),
                        (logits_controls_module, "reshape_staged", rows_owner)],
    "grammar": [(RequestGrammar, "fill_masks", GrammarOf)],
    "sampling": [(step_rows_module, "target_probs_rows", row_params_owner),
                 (step_rows_module, "target_probs", params_owner),
                 (sampler_module, "target_probs", params_owner)],
    "acceptance": [(step_rows_module, "verdict_of", lambda engine: lambda part, host: part.request)],
    "commit": [(commit_module.TokenCommitter, "commit", lambda engine: lambda committer, req, *a: req)],
    "detokenizing": [(commit_module, "append_token_text", lambda engine: lambda tokenizer, req: req),
                     (commit_module, "append_step_text", lambda engine: lambda tokenizer, req, count: req)],
    "logprobs": [(engine_module, "logprobs_of", lambda engine: lambda read, rid: engine.requests.get(rid))],
    "output": [(engine_module, "take_text", lambda engine: lambda req: req)],
}


# an unseeded sampled victim without drafts has no acceptance step (it draws its one token): its acceptance fault is
# injected into the seeded victim, whose every token is verified
CASES = [(stage, seed) for stage in FAULTS for seed in (None, 5) if (stage, seed) != ("acceptance", None)]


@pytest.mark.parametrize("stage,victim_seed", CASES)
def test_a_fault_at_each_stage_ends_its_request_alone(stage, victim_seed, llm, clean, monkeypatch):
    engine = llm.engine
    for target, name, finder in FAULTS[stage]:
        monkeypatch.setattr(target, name, failing_for_victim(getattr(target, name), finder(engine)))
    got = run(llm, with_victim=True, victim_seed=victim_seed)
    victim = got.pop(VICTIM)
    assert victim.finish_reason == "error" and f"this request's {stage}" in victim.error, victim.error
    assert "injected fault" in victim.error
    for rid, out in got.items():
        assert out.token_ids == clean[rid].token_ids and out.finish_reason == clean[rid].finish_reason, rid
    assert engine.blocks.num_free == engine.blocks.num_blocks  # every request's KV is back, the victim's too
    assert not engine.requests and not engine.grammars
    monkeypatch.undo()
    again = run(llm, with_victim=True, victim_seed=victim_seed)  # and the engine serves on as before
    assert again.pop(VICTIM).finish_reason == "length"
    assert {r: o.token_ids for r, o in again.items()} == {r: o.token_ids for r, o in got.items()}


def test_a_forward_that_fails_once_is_run_again_without_speculation(llm, clean, monkeypatch):
    """The retried step verifies no drafts, so every request's output is the same (lossless either way)."""
    runner = llm.engine.runner
    real, calls = runner.forward, [0]

    def forward(items):
        calls[0] += 1
        if calls[0] == 4:
            assert any(len(it.tokens) > 1 for it in items if it.request.num_output_tokens)  # it had drafts
            raise RuntimeError("injected forward fault")
        return real(items)
    monkeypatch.setattr(runner, "forward", forward)
    got = run(llm, with_victim=True)
    assert {r: o.token_ids for r, o in got.items() if r != VICTIM} == \
        {r: o.token_ids for r, o in clean.items() if r != VICTIM}
    assert all(o.finish_reason != "error" for o in got.values())


def test_a_forward_that_fails_twice_ends_that_steps_requests_and_no_later_one(llm, monkeypatch):
    engine = llm.engine
    runner = engine.runner
    real, calls = runner.forward, [0]

    def forward(items):
        calls[0] += 1
        if calls[0] in (3, 4):
            raise RuntimeError("injected forward fault")
        return real(items)
    monkeypatch.setattr(runner, "forward", forward)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    engine.add_request(PROMPTS[0], params, request_id="first")
    ended = {}
    for _ in range(3):
        for out in engine.step():
            ended[out.request_id] = out
    assert ended["first"].finish_reason == "error" and "forward" in ended["first"].error
    engine.add_request(PROMPTS[1], params, request_id="later")
    while engine.has_unfinished():
        for out in engine.step():
            ended[out.request_id] = out
    assert ended["later"].finish_reason == "length" and len(ended["later"].token_ids) == 6
    assert engine.blocks.num_free == engine.blocks.num_blocks


def run_beside_bystanders(llm, prompt: str, params: SamplingParams) -> tuple[object, dict[str, object]]:
    """The victim (prompt, params) in a batch with the bystanders: its output, and theirs by request id."""
    engine, got = llm.engine, {}
    for i, (p, b) in enumerate(zip(PROMPTS, bystanders())):
        engine.add_request(p, b, request_id=f"b{i}")
    engine.add_request(prompt, params, request_id=VICTIM)
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out
    return got.pop(VICTIM), got


def test_the_reported_request_gets_past_the_front_only_if_the_front_forgets_it(llm, clean, monkeypatch):
    """regex "()" admits only the empty output; min_tokens 1 holds the end back: the row has no finite logit. The
    front refuses it (test_impossible.py); with that check taken out, the step's guard ends it naming both fields,
    the sampler never sees the row, and the batch is unharmed."""
    monkeypatch.setattr(engine_module, "refuse_impossible", lambda *a: None)
    victim, got = run_beside_bystanders(llm, "zzz", SamplingParams(max_tokens=8, temperature=1.0, min_tokens=1,
                                                                   structured=StructuredOutput(regex="()")))
    assert victim.finish_reason == "error" and victim.token_ids == []
    assert "min_tokens=1" in victim.error and "structured_outputs.regex" in victim.error, victim.error
    assert {r: o.token_ids for r, o in got.items()} == {r: o.token_ids for r, o in clean.items() if r != VICTIM}
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks


def test_non_finite_logits_from_the_model_end_that_request_alone(llm, clean, monkeypatch):
    """The model's row for one request turns NaN mid-generation (an overflow, say): that request ends saying so."""
    engine = llm.engine
    runner = engine.runner
    real, steps = runner.forward, [0]

    def forward(items):
        logits = real(items).clone()
        steps[0] += 1
        row = 0
        for it in items:
            if it.request.request_id == VICTIM and steps[0] >= 4 and it.num_logits:
                logits[row] = float("nan")
            row += it.num_logits
        return logits
    monkeypatch.setattr(runner, "forward", forward)
    victim, got = run_beside_bystanders(llm, "zzz yyy zzz", victim_params(5))
    assert victim.finish_reason == "error" and "not finite" in victim.error, victim.error
    assert {r: o.token_ids for r, o in got.items()} == {r: o.token_ids for r, o in clean.items() if r != VICTIM}


def test_a_policy_that_fails_to_observe_costs_no_request(llm, clean, monkeypatch):
    policy = llm.engine.speculation.policy

    def observe(record):
        raise RuntimeError("injected policy fault")
    monkeypatch.setattr(policy, "observe", observe)
    got = run(llm, with_victim=True)
    assert {r: o.token_ids for r, o in got.items() if r != VICTIM} == \
        {r: o.token_ids for r, o in clean.items() if r != VICTIM}


def test_the_offline_api_reports_an_error_it_ended(llm, monkeypatch):
    real = commit_module.append_step_text  # requests without stop strings: a step's tokens decoded at once

    def append_step_text(tokenizer, req, count):
        if req.params.max_tokens == 7:
            raise RuntimeError("injected fault")
        return real(tokenizer, req, count)
    monkeypatch.setattr(commit_module, "append_step_text", append_step_text)
    outs = llm.generate(["hello", "world"], [SamplingParams(max_tokens=7), SamplingParams(max_tokens=5)])
    assert outs[0].finish_reason == "error" and "detokenizing" in outs[0].error
    assert outs[1].finish_reason == "length" and outs[1].error is None and len(outs[1].token_ids) == 5
