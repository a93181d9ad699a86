"""The policy's view of a step, built from engine Requests as the engine's planner builds it (for policy tests)."""
from smartspec.engine.planner import step_view
from smartspec.types.plan import PrefillView, StepView


def view(requests, k_max, base_tokens=0, base_context=0, prefilling=(), now=None, lookups=None, use_draft=False,
         joining=(), draft_held: dict[str, int] | None = None):
    """joining: those of `prefilling` whose prompt the step completes (the next step's newcomers); draft_held:
    per request id, the tokens of its context the draft would not read (Proposer.held_tokens; others 0)."""
    held_of = None if draft_held is None else (lambda rs: [draft_held.get(r.request_id, 0) for r in rs])
    return StepView(step_view(requests, [], k_max, held_of=held_of).requests, k_max, base_tokens, base_context,
                    [PrefillView(r.request_id, r.arrival_time) for r in prefilling], now, lookups, use_draft,
                    joining=step_view(list(joining), [], k_max, held_of=held_of).requests if joining else None)
