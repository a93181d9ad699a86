"""The warm-up profile kept on disk (EngineConfig.profile_cache), per engine configuration and machine: an engine
started again on the same box (a replica Serve restarts, a second replica) takes the step costs its predecessor
measured instead of measuring them again. A start is shorter by the profile's time (11 s for the default pair on 2
cores), and one on a loaded box keeps the profile its predecessor took, rather than measuring the load; the cost
fit follows the speed it then meets (policy/cost_model.py, policy/speed_change.py).

The key is what the costs depend on: the models and their quantization, the proposer and k_max, dtype, device,
threads, block size, the kernels (their sources: a changed kernel runs at another speed), the CPU and the smartspec
and torch versions. A file that cannot be read is measured over; a profile of token trees is not kept (its records
carry trees). The acceptance calibration is kept beside it (the draft's outcomes and the answers, along which
lookups are replayed): a restarted replica starts from the acceptance its predecessor measured, without measuring
again. It still runs one short request through both models (profile.warm_up_forwards): their first forwards in a
process cost several times the next ones."""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import time
from pathlib import Path
from typing import NamedTuple

import torch

from smartspec.models.registry import cache_root
from smartspec.runtime import kernels
from smartspec.types.step_record import StepRecord

logger = logging.getLogger(__name__)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version() -> str:
    try:
        return importlib.metadata.version("smartspec")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


# what engine/profile.py's profile_steps measures; a kept profile of another is measured again (2: two full-k
# drafting steps a shape, the first after the prompt's catch-up and the second after none; 3: after a warm-up
# request through both models, so no shape's step is a model's first forward)
PROFILE_STEPS = 3


def profile_path(config, batches: tuple[int, ...], context: int, calibration: tuple = ()) -> Path:
    """Where the profile of an engine of this config (EngineConfig) would be kept; `calibration` names how the
    acceptance calibration is measured (a changed one is measured again)."""
    spec = config.speculative_config
    what = {"model": config.model, "quantization": config.quantization, "dtype": config.dtype,
            "device": config.device, "threads": config.num_threads or torch.get_num_threads(),
            "block_size": config.block_size, "kernels": config.use_kernels and kernels.source_digest(),
            "cuda_graphs": config.cuda_graphs, "prefix_caching": config.enable_prefix_caching,
            "speculation": spec.as_dict() if spec else None,
            "batches": list(batches), "context": context, "cpu": cpu_name(), "cores": os.cpu_count(),
            "smartspec": _version(), "torch": torch.__version__, "calibration": calibration,
            "profile_steps": PROFILE_STEPS}
    key = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:24]
    return cache_root() / "profiles" / f"{key}.json"


class Calibration(NamedTuple):
    """The start's acceptance calibration (engine/profile.py)."""
    records: list[StepRecord]  # the draft model's chains along the answers (none without a draft model)
    answers: list[tuple[list[int], list[int]]]  # each question's prompt and greedy answer, token ids


class KeptProfile(NamedTuple):
    records: list[StepRecord]  # the warm-up profile's steps
    calibration: Calibration


def load_profile(path: Path) -> KeptProfile | None:
    """The kept profile and calibration; None where there is none or it cannot be read."""
    try:
        kept = json.loads(path.read_text())
        profile = KeptProfile([StepRecord(**r) for r in kept["records"]],
                              Calibration([StepRecord(**r) for r in kept["calibration"]],
                                          [(list(prompt), list(output)) for prompt, output in kept["answers"]]))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.warning("warm-up profile %s unreadable (%r): measuring it again", path, exc)
        return None
    logger.info("warm-up profile from %s, measured %s", path, kept.get("measured", "?"))
    return profile


def save_profile(path: Path, profile: KeptProfile) -> None:
    """Keep the profile at path (atomically: a replica starting beside reads a whole file or none)."""
    if not profile.records or any(r.trees for r in profile.records):
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps({"measured": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                                       "records": [dataclasses.asdict(r) for r in profile.records],
                                       "calibration": [dataclasses.asdict(r) for r in profile.calibration.records],
                                       "answers": profile.calibration.answers}))
        os.replace(partial, path)
    except OSError as exc:
        logger.warning("warm-up profile not kept at %s: %r", path, exc)
