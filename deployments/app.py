"""The application builder `serve run config.yaml` calls: `import_path: deployments.app:build_app`, `args:` an
AppConfig (see control/config.py and the option table in docs/serving.md)."""
from __future__ import annotations

from functools import partial

from ray.serve import Application

from deployments.control.config import AppConfig, AutoscalingConfig
from deployments.control.controller import GoodputController
from deployments.http.ingress import OpenAIIngress
from deployments.replica.parts import EngineFactory, start_engine, start_paced_engine
from deployments.replica.server import LLMServer


def llm_server_options(cfg: AppConfig) -> dict:
    # the replica and what it starts share one placement group: its draft actor and TP workers land beside it
    replica = {"CPU": cfg.replica_num_cpus, **({"GPU": cfg.replica_num_gpus} if cfg.replica_num_gpus else {})}
    bundles = [replica]
    if cfg.draft_actor:
        bundles.append({"CPU": cfg.speculation.draft_num_cpus})
    tp_bundle = {"CPU": cfg.tp_num_cpus, **({"GPU": 1} if cfg.device == "cuda" else {})}
    bundles += [tp_bundle] * (cfg.tensor_parallel_size if cfg.tensor_parallel_size > 1 else 0)
    options = {"ray_actor_options": {"num_cpus": cfg.replica_num_cpus, "num_gpus": cfg.replica_num_gpus},
               "max_ongoing_requests": cfg.max_ongoing_requests, "max_queued_requests": cfg.max_queued_requests,
               "health_check_period_s": 10, "graceful_shutdown_timeout_s": cfg.drain_timeout_s}
    if len(bundles) > 1:
        options.update(placement_group_bundles=bundles, placement_group_strategy="PACK")
    if cfg.max_replicas_per_node is not None:
        options["max_replicas_per_node"] = cfg.max_replicas_per_node
    if cfg.router == "goodput":
        options["request_router_config"] = {"request_router_class": "deployments.placement.router:GoodputRouter",
                                            "request_routing_stats_period_s": cfg.router_stats_period_s,
                                            "request_routing_stats_timeout_s": max(5.0, cfg.router_stats_period_s)}
    if cfg.autoscaling is not None:
        options["autoscaling_config"] = autoscaling_config(cfg.autoscaling)
    else:
        options["num_replicas"] = cfg.num_replicas
    return options


def autoscaling_config(a: AutoscalingConfig) -> dict:
    config = {"min_replicas": a.min_replicas, "max_replicas": a.max_replicas,
              "target_ongoing_requests": a.target_ongoing_requests, "upscale_delay_s": a.upscale_delay_s,
              "downscale_delay_s": a.downscale_delay_s, "look_back_period_s": a.look_back_period_s,
              "metrics_interval_s": min(1.0, a.look_back_period_s / 2)}  # Serve: look-back > interval
    if a.policy == "goodput":
        config["policy"] = {"policy_function": "deployments.placement.autoscaling:goodput_policy",
                            "policy_kwargs": {"min_speed_fraction": a.min_speed_fraction}}
    return config


def build_app(args: dict | None = None) -> Application:
    return _application(AppConfig.model_validate(args or {}), start_engine)


def build_paced_app(args: dict | None = None) -> Application:
    """The same application over an engine without a model that emits a token to every running request each
    `paced_step_s` seconds (given beside AppConfig's fields; default 0.05): the serving path alone, for
    scripts/bench_serving_path.py."""
    args = dict(args or {})
    step_s = args.pop("paced_step_s", 0.05)
    if not (isinstance(step_s, (int, float)) and step_s > 0):
        raise ValueError(f"paced_step_s must be seconds > 0, got {step_s!r}")
    return _application(AppConfig.model_validate({"model": "paced", "speculation": None, **args}),
                        partial(start_paced_engine, float(step_s)))


def _application(cfg: AppConfig, engine_factory: EngineFactory) -> Application:
    controller = GoodputController.bind()
    server = LLMServer.options(**llm_server_options(cfg)).bind(cfg.model_dump(), controller, engine_factory)
    # the ingress holds its streams until they end: replaced in a redeploy, it finishes them first, as long as a
    # replica does (Serve's default of 20 s cut streams that a loaded replica was still generating)
    ingress = OpenAIIngress.options(graceful_shutdown_timeout_s=cfg.drain_timeout_s)
    return ingress.bind(server, controller, cfg.name, api_key=cfg.api_key, metrics_need_key=cfg.metrics_need_key,
                        replica_wait_s=cfg.replica_wait_s, channels=cfg.stream_channels and cfg.router == "goodput")
