"""The policy learns from a step, and may plan the next one, while the next step's forward runs.

On a GPU the target's forward is queued on the device and runs while the host goes on until the step reads its
result back (the accept stage): work placed there (the acceptance fold, the cost feed, now and then a refit, a full
plan made a step early: Policy.plan_ahead) costs a step nothing where the device takes longer, instead of being
added to every step. On a CPU the forward runs on the host: observing costs what it did after the step, and the
policy does not plan ahead (StepObserver.plans_ahead). A step's plan is made before its forward, so on what the
policy knew one step earlier (a plan made ahead, two): steps of a few hundred, a difference no estimate shows.

A record waits at most one step: where no step follows (the engine has nothing left to run, or swaps its
speculation) it is observed at once. A failure to observe costs the policy its learning, never the requests."""
from __future__ import annotations

import logging
import time

from smartspec.policy import Policy
from smartspec.types.plan import StepView
from smartspec.types.step_record import StepRecord

logger = logging.getLogger(__name__)


class StepObserver:
    def __init__(self, plans_ahead: bool, raises: bool = False) -> None:
        """plans_ahead: whether the policy plans ahead beside the forward (Policy.plan_ahead): where the forward runs
        asynchronously (a GPU). On a CPU a plan made ahead only moves the work, or adds some where the next step
        turns out otherwise than planned for (a step beside prefill followed by one without). raises: a policy's
        failure to observe or plan ahead propagates instead of being logged (the simulator: what drives a policy
        through it must see it fail)."""
        self.plans_ahead, self.raises = plans_ahead, raises
        self._waiting: tuple[Policy, StepRecord] | None = None  # the last step's record and the policy it is for

    def hold(self, policy: Policy, record: StepRecord) -> float:
        """Keep a step's record for the next step's forward (one waiting before it is observed now); the seconds
        the policy spent observing."""
        spent = self.observe_waiting()
        self._waiting = (policy, record)
        return spent

    def beside_forward(self, policy: Policy, view: StepView | None) -> float:
        """What runs beside a step's forward: the waiting record observed, then, where it plans ahead, the policy's
        plan ahead on this step's view (None: the step planned nothing); the seconds both took."""
        spent = self.observe_waiting()
        if view is None or not self.plans_ahead:
            return spent
        return spent + self._timed(policy.plan_ahead, view, "policy %r failed to plan ahead", policy.name)

    def observe_waiting(self) -> float:
        """The waiting record observed by its policy, if any; the seconds that took."""
        if self._waiting is None:
            return 0.0
        (policy, record), self._waiting = self._waiting, None
        return self._timed(policy.observe, record, "policy %r failed to observe step %d", policy.name, record.step)

    def _timed(self, work, argument, failure: str, *failure_args) -> float:
        """work(argument), its seconds; what it raises is raised again (raises) or logged with `failure`."""
        began = time.perf_counter()
        try:
            work(argument)
        except Exception:
            if self.raises:
                raise
            logger.exception(failure, *failure_args)
        return time.perf_counter() - began
