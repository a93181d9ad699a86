"""GoodputController's merge: each replica gets the other replicas' evidence, never its own back."""
import pytest

pytest.importorskip("ray.serve")

from deployments.control.controller import ControllerState  # noqa: E402
from deployments.control.metrics import render_replica_metrics  # noqa: E402
from deployments.wire import ReplicaGauges, ReplicaReport  # noqa: E402
from smartspec.policy.goodput_policy import GoodputPolicy  # noqa: E402


def _policy(accept: bool, scale: float) -> GoodputPolicy:
    p = GoodputPolicy(key="draft_model:d")
    for _ in range(30):
        p.acceptance.observe("r", 4, 4 if accept else 0)
    for n in (1, 2, 4, 8, 16):
        p.cost.observe(n, 100, 0, 0, 0.0, scale * (0.01 + 0.001 * n))
    return p


def _report(replica: str, running: int, policy: GoodputPolicy) -> ReplicaReport:
    state = policy.shared.export_state()
    gauges = ReplicaGauges(running=running, by_source={"draft_model": (3, 9, 7)}, chosen_k={0: 2, 4: 5},
                           **policy.shared.acceptance_stats())
    return ReplicaReport(replica, gauges, {"running": running}, state)


def test_controller_aggregates_two_replicas_without_double_counting():
    good, bad = _policy(True, 1.0), _policy(False, 2.0)
    state = ControllerState()
    assert state.report(_report("a", 1, good)) == {}  # alone: nothing to learn
    merged_for_b = state.report(_report("b", 3, bad))
    report_a = _report("a", 1, good)
    merged_for_a = state.report(report_a)
    assert merged_for_b["prior"] == good.shared.export_state()["prior"] and merged_for_b["replicas"] == 1
    assert merged_for_a["prior"] == bad.shared.export_state()["prior"]

    own_before = dict(vars(good.acceptance.first.prior_counts))
    alone = good.acceptance.first.prior
    good.shared.import_state(merged_for_a)
    good.shared.import_state(merged_for_a)  # importing again replaces, never accumulates
    assert dict(vars(good.acceptance.first.prior_counts)) == own_before  # its own evidence is what it exports
    assert bad.acceptance.first.prior < good.acceptance.first.prior < alone  # both replicas' evidence now counts

    status = state.status()
    shown = status.as_dict()
    assert set(shown["replicas"]) == {"a", "b"} and shown["replicas"]["b"]["running"] == 3
    assert shown["merged_policy"]["replicas"] == 2
    # both acceptance stages reach /metrics, per replica
    later = report_a.gauges.alpha_prior_later
    assert 0 < shown["replicas"]["a"]["alpha_prior_later"] == later < 1
    text = render_replica_metrics(status)
    assert f'smartspec_acceptance_prior_later{{replica="a"}} {float(later)}' in text
    assert 'smartspec_requests_running{replica="b"} 3.0' in text
    assert 'smartspec_spec_decode_num_accepted_tokens_by_source_total{replica="a",source="draft_model"} 7.0' in text
    assert 'smartspec_chosen_k_total{replica="b",k="4"} 5.0' in text


def test_controller_forgets_replicas_that_stop_reporting():
    state = ControllerState(stale_after_s=0.0)
    state.report(_report("a", 0, _policy(True, 1.0)))
    assert state.report(_report("b", 0, _policy(False, 1.0))) == {}  # "a" is stale: gone


def test_the_http_front_and_the_controller_load_no_torch():
    """Their Serve replicas hold 0.2 GiB instead of 0.5: only the LLMServer process needs the engine."""
    import subprocess
    import sys

    code = ("import sys, deployments.http.ingress, deployments.control.controller, smartspec, smartspec.policy; "
            "smartspec.policy.merge_states([]); assert 'torch' not in sys.modules, 'torch imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
