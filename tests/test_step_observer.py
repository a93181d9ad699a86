"""The policy observes each step beside the next step's forward (engine/step_observer.py): every record once, in
order, after the next forward is issued and before its result is read; at once where no step follows. The
simulator runs it the same way, and charges it only what it outlasts the forward on an asynchronous device."""
from types import SimpleNamespace

import numpy as np
import pytest

from engines import PROMPTS, StepPolicy, make
from smartspec import SamplingParams
from smartspec.engine.step_observer import StepObserver
from smartspec.policy.cost_model import StepCostModel
from smartspec.sim.profile import SimProfile
from smartspec.sim.realism import Realism
from smartspec.sim.simulator import ReplicaSize, SimReplica
from smartspec.types.request import Request
from smartspec.types.sampling_params import SamplingParams as Params


class LoggingPolicy(StepPolicy):
    """k = 2 for every request; logs each plan and each observed record."""

    def __init__(self, log: list):
        super().__init__(lambda step, i, k_max: 2)
        self.log = log

    def choose_ks(self, view):
        self.log.append(("plan", self.step + 1))
        return super().choose_ks(view)

    def observe(self, record):
        self.log.append(("observe", record.step))


def test_each_step_is_observed_once_beside_the_next_forward_and_the_last_at_once(tiny_qwen, monkeypatch):
    import smartspec.engine.llm_engine as llm_engine
    log: list = []
    llm = make(tiny_qwen, {"method": "ngram", "num_speculative_tokens": 3, "policy": LoggingPolicy(log)})
    runner = llm.engine.runner
    forward, accept = runner.forward, llm_engine.accept_drafts
    runner.forward = lambda items: (log.append("forward"), forward(items))[1]
    monkeypatch.setattr(llm_engine, "accept_drafts", lambda *a: (log.append("read"), accept(*a))[1])
    llm.generate(PROMPTS[:2], SamplingParams(max_tokens=6, ignore_eos=True))
    steps = llm.engine.num_steps
    # step n's record: after step n + 1's forward is issued, before its result is read; the last step's at once
    expected = ["forward", "read"] + [e for n in range(1, steps) for e in ("forward", ("observe", n), "read")]
    assert steps > 3 and [e for e in log if e[0] != "plan"] == expected + [("observe", steps)]


def test_a_policy_that_fails_to_observe_costs_its_learning_not_the_requests(tiny_qwen):
    policy = LoggingPolicy([])
    policy.observe = lambda record: 1 / 0
    llm = make(tiny_qwen, {"method": "ngram", "num_speculative_tokens": 3, "policy": policy})
    plain = make(tiny_qwen).generate(PROMPTS[:2], SamplingParams(max_tokens=6, ignore_eos=True))
    outs = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=6, ignore_eos=True))
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]


def test_a_waiting_record_is_observed_by_the_policy_that_planned_it(tiny_qwen):
    old, new = [], []
    llm = make(tiny_qwen, {"method": "ngram", "num_speculative_tokens": 3, "policy": LoggingPolicy(old)})
    engine = llm.engine
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=20, ignore_eos=True), request_id="a")
    engine.step()
    engine.step()
    engine.abort_request("a")  # idle, with step 2's record waiting
    engine.set_speculation(policy=LoggingPolicy(new))
    assert [e for e in old if e[0] == "observe"] == [("observe", 1), ("observe", 2)] and new == []
    assert StepObserver(plans_ahead=False).observe_waiting() == 0.0
    assert not engine.observer.plans_ahead  # a CPU's forward runs on the host: nothing to plan beside


def test_the_policy_plans_ahead_beside_an_asynchronous_forward_alone():
    planned = []

    class Ahead(LoggingPolicy):
        def plan_ahead(self, view):
            planned.append(view)

    for plans_ahead in (False, True):
        observer = StepObserver(plans_ahead)
        observer.beside_forward(Ahead([]), "the step's view")
        observer.beside_forward(Ahead([]), None)  # nothing planned this step
    assert planned == ["the step's view"]


class FakeClock:
    """perf_counter for the simulator: moves only when the policy observes (by `observe_s`), so a step's host
    time is known exactly."""

    def __init__(self, observe_s: float):
        self.now, self.observe_s = 0.0, observe_s

    def perf_counter(self):
        return self.now


def replica_ends(asynchronous: bool, observe_s: float, monkeypatch) -> list[float]:
    """The ends of the steps of one request on a replica whose forward takes 50 ms, its policy 0 s to plan and
    `observe_s` to observe each step."""
    import smartspec.engine.step_observer as step_observer
    import smartspec.sim.simulator as simulator
    clock = FakeClock(observe_s)
    monkeypatch.setattr(simulator, "time", clock)
    monkeypatch.setattr(step_observer, "time", clock)
    cost = StepCostModel()
    cost.v, cost.d = [0.05, 0, 0, 0, 0, 0, 0, 0.0], [0.0, 0.0, 0.0]
    rep = SimReplica(SimProfile(cost, [0.5], asynchronous=asynchronous), "fixed:0", 2, np.random.default_rng(0),
                     ReplicaSize(64, 16, 4, 64, 512), Realism(host_s="measured"))
    observe = rep.speculation.policy.observe

    def slow_observe(record):
        clock.now += clock.observe_s
        observe(record)

    rep.speculation.policy.observe = slow_observe
    rep.add(Request("r", [1] * 20, Params(max_tokens=6, ignore_eos=True)))
    ends, now = [], 0.0
    while rep.scheduler.has_unfinished():
        now = rep.step(now).end
        ends.append(now)
    return ends


@pytest.mark.parametrize("observe_s", [0.01, 0.08])
def test_on_an_asynchronous_device_observing_costs_what_it_outlasts_the_forward(observe_s, monkeypatch):
    # six steps (a prefill, five decodes): step n > 1 observes step n - 1 beside its 50 ms forward
    plain = [0.05 * (n + 1) for n in range(6)]
    beside = replica_ends(True, observe_s, monkeypatch)
    after = replica_ends(False, observe_s, monkeypatch)
    assert after == pytest.approx([p + observe_s * n for n, p in enumerate(plain)])
    assert beside == pytest.approx([p + max(0.0, observe_s - 0.05) * n for n, p in enumerate(plain)])


def test_a_policy_that_fails_to_observe_fails_the_simulation_and_not_the_engine():
    """The simulator drives policies for their tests and studies: a failure must surface there; the engine's
    observer logs it and serves on (test_a_policy_that_fails_to_observe_costs_its_learning_not_the_requests)."""
    class Broken(LoggingPolicy):
        def observe(self, record):
            raise RuntimeError("broken observe")

    cost = StepCostModel()
    cost.v, cost.d = [0.05, 0, 0, 0, 0, 0, 0, 0.0], [0.0, 0.0, 0.0]
    rep = SimReplica(SimProfile(cost, [0.5]), Broken([]), 2, np.random.default_rng(0), ReplicaSize(64, 16, 4, 64, 512))
    rep.add(Request("r", [1] * 20, Params(max_tokens=6, ignore_eos=True)))
    with pytest.raises(RuntimeError, match="broken observe"):
        now = 0.0
        while rep.scheduler.has_unfinished():
            now = rep.step(now).end
    observer = StepObserver(plans_ahead=False)
    observer.hold(Broken([]), SimpleNamespace(step=1))
    assert observer.observe_waiting() >= 0.0  # logged, not raised
