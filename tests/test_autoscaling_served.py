"""The goodput autoscaling policy (deployments/placement/autoscaling.py) run by Serve's own controller: replicas
report their load and speed table through `record_autoscaling_stats`, Serve calls `goodput_policy` with them, and
the replica count follows its answer up and back down."""
import os
import time

from ray import serve

from deployments.app import autoscaling_config
from deployments.control.config import AutoscalingConfig


def _running(app: str) -> int:
    (deployment,) = serve.status().applications[app].deployments.values()
    return deployment.replica_states.get("RUNNING", 0)


def _wait_for(app: str, replicas: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _running(app) != replicas:
        assert time.monotonic() < deadline, f"{app}: {_running(app)} replicas running, not {replicas}"
        time.sleep(0.25)


def test_served_replicas_follow_the_goodput_policy(ray_serve, tmp_path):
    """Four requests held on one replica whose speed table halves at batch 2 (max_num_seqs 2): Serve's own rule
    (4 / target_ongoing_requests 100) keeps one replica, the goodput rule wants two, so a second replica means
    Serve ran the policy on the reported numbers. Released, the load is gone and it scales back to one."""
    from deployments.placement.autoscaling import autoscaling_metrics

    @serve.deployment(ray_actor_options={"num_cpus": 0.05}, max_ongoing_requests=16)
    class Held:
        """Holds each request until a file appears; reports its load as an LLMServer replica does."""

        def __init__(self) -> None:
            self.in_flight = 0

        async def __call__(self, release: str) -> int:
            import asyncio

            self.in_flight += 1
            try:
                while not os.path.exists(release):
                    await asyncio.sleep(0.05)
            finally:
                self.in_flight -= 1
            return os.getpid()

        def record_autoscaling_stats(self) -> dict:
            return autoscaling_metrics(self.in_flight, 2, {1: 20.0, 2: 10.0})

    config = autoscaling_config(AutoscalingConfig(min_replicas=1, max_replicas=3, target_ongoing_requests=100,
                                                  upscale_delay_s=0, downscale_delay_s=1, look_back_period_s=1))
    assert config["policy"]["policy_function"] == "deployments.placement.autoscaling:goodput_policy"
    handle = serve.run(Held.options(autoscaling_config=config).bind(), name="autoscale",
                       route_prefix="/autoscale-test")
    release = tmp_path / "release"
    try:
        _wait_for("autoscale", 1)
        held = [handle.remote(str(release)) for _ in range(4)]
        _wait_for("autoscale", 2)
        release.touch()
        for r in held:  # every held request answers: scaling lost none
            r.result(timeout_s=60)
        _wait_for("autoscale", 1)
    finally:
        release.touch()
        serve.delete("autoscale")
