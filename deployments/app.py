"""The application builder `serve run config.yaml` calls: `import_path: deployments.app:build_app`, `args:` an
AppConfig (see deployments/config.py and the README's option table)."""
from __future__ import annotations

from ray.serve import Application

from deployments.config import AppConfig
from deployments.controller import GoodputController
from deployments.ingress import OpenAIIngress
from deployments.llm_server import LLMServer


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
               "health_check_period_s": 10, "graceful_shutdown_timeout_s": 5}
    if len(bundles) > 1:
        options.update(placement_group_bundles=bundles, placement_group_strategy="PACK")
    if cfg.autoscaling is not None:
        a = cfg.autoscaling
        options["autoscaling_config"] = {"min_replicas": a.min_replicas, "max_replicas": a.max_replicas,
                                         "target_ongoing_requests": a.target_ongoing_requests}
    else:
        options["num_replicas"] = cfg.num_replicas
    return options


def build_app(args: dict | None = None) -> Application:
    cfg = AppConfig.model_validate(args or {})
    controller = GoodputController.bind()
    server = LLMServer.options(**llm_server_options(cfg)).bind(cfg.model_dump(), controller)
    return OpenAIIngress.bind(server, controller, cfg.name)
