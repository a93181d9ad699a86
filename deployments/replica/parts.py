"""Where a replica's engine runs its parts: the target's forward in this process or over tensor-parallel workers,
the draft model in this process or in an actor of its own; and the engine itself (`start_engine`)."""
from __future__ import annotations

from collections.abc import Callable

from deployments.control.config import AppConfig
from smartspec.engine.async_engine import AsyncEngine
from smartspec.engine.client import EngineClient
from smartspec.engine.llm_engine import LLMEngine
from smartspec.spec_decode.factory import make_draft_proposer


def runner_factory(cfg: AppConfig) -> Callable | None:
    """Tensor-parallel workers for the target where tensor_parallel_size > 1; None: the engine's own runner."""
    if cfg.tensor_parallel_size == 1:
        return None
    from deployments.replica.tp_workers import TPModelRunner, TPSettings

    engine = cfg.engine_config()  # quantization and dtype as the engine reads them ("auto" resolved)
    settings = TPSettings(cfg.tensor_parallel_size, engine.dtype, cfg.device, engine.quantization, cfg.tp_num_cpus,
                          1 if cfg.device == "cuda" else 0, cfg.threads)
    return lambda loaded, blocks: TPModelRunner(loaded, blocks, settings)


def draft_factory(cfg: AppConfig, replica_id: str, named: Callable[[str], None]) -> Callable:
    """The draft model in its own Ray actor (speculation.draft_actor), else in this process; named(actor name)
    is told once the actor is started."""
    if not cfg.draft_actor:
        return make_draft_proposer
    from deployments.replica.draft_worker import start_draft_actor

    def make(spec_config, runtime):
        name = f"smartspec-draft-{replica_id}"
        named(name)
        return start_draft_actor(name, spec_config, runtime, cfg.model, spec_config.draft_num_threads or cfg.threads)

    return make


EngineFactory = Callable[[AppConfig, str, Callable[[str], None]], EngineClient]


def start_engine(cfg: AppConfig, replica_id: str, named: Callable[[str], None]) -> EngineClient:
    """The replica's engine, stepping on its own thread, with its parts placed as configured (named: as in
    draft_factory)."""
    return AsyncEngine(build=lambda: LLMEngine(cfg.engine_config(replica_id), runner_factory=runner_factory(cfg),
                                               draft_factory=draft_factory(cfg, replica_id, named)))


def start_paced_engine(step_s: float, cfg: AppConfig, replica_id: str, named: Callable[[str], None]) -> EngineClient:
    """An engine without a model that emits a token to every running request each step_s seconds
    (smartspec/bench/paced_engine.py): the serving path measured alone (scripts/bench_serving_path.py)."""
    from smartspec.bench.paced_engine import PacedEngine

    return AsyncEngine(engine=PacedEngine(step_s, cfg.max_num_seqs, cfg.max_model_len or 4096))
