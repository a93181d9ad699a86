"""The policy's view of a step, built from engine Requests as the engine's planner builds it (for policy tests)."""
from smartspec.engine.planner import step_view
from smartspec.types.plan import PrefillView, StepView


def view(requests, k_max, base_tokens=0, base_context=0, prefilling=(), now=None, lookups=None, use_draft=False,
         joining=()):
    """joining: those of `prefilling` whose prompt the step completes (the next step's newcomers)."""
    return StepView(step_view(requests, [], k_max).requests, k_max, base_tokens, base_context,
                    [PrefillView(r.request_id, r.arrival_time) for r in prefilling], now, lookups, use_draft,
                    joining=step_view(list(joining), [], k_max).requests if joining else None)
