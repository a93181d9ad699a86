"""The warm-up profile kept on disk (EngineConfig.profile_cache), per engine configuration and machine: an engine
started again on the same box (a replica Serve restarts, a second replica) takes the step costs its predecessor
measured instead of measuring them again. A start is shorter by the profile's time (11 s for the default pair on 2
cores), and one on a loaded box keeps the profile its predecessor took, rather than measuring the load; the cost
fit follows the speed it then meets (policy/cost_model.py, policy/speed_change.py).

The key is what the costs depend on: the models (their files' content, not only their names) and their
quantization, the proposer and k_max, dtype, the device by name (the CPU's model, or the GPU's), threads, block
size, the code that sets a step's cost (the sources of the step's packages and of the kernels: changed code runs at
another speed), and the smartspec and torch versions. A kept profile is checked against the first steps it
predicts (`KeptProfileCheck`): where they disagree it is dropped, and measured again once the engine is idle. A file that cannot be read is measured over; a profile of token trees is not kept (its records
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


def device_name(device: str) -> str:
    """The device a profile was measured on, by name: the CPU's model, or the accelerator's."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return cpu_name()


# the packages whose code runs in a step: a change in any of them may change what a step costs
STEP_CODE = ("runtime", "models", "spec_decode", "engine", "structured")


def step_code_digest() -> str:
    """A digest of the code that sets a step's cost: the sources of STEP_CODE and of the kernels."""
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parent.parent
    for package in STEP_CODE:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(path.relative_to(root).as_posix().encode())
            digest.update(path.read_bytes())
    digest.update(kernels.source_digest().encode())
    return digest.hexdigest()[:16]


SAMPLED_BLOCKS, BLOCK_BYTES = 16, 1 << 16


def model_digest(model: str | None) -> str | None:
    """A digest of a model's files' content (their names, sizes and 16 blocks spread over each file: a changed
    file almost surely changes one, at a read of 1 MiB a file, not the gigabytes a full hash reads); None for a
    name that is no local path (a hub id)."""
    if model is None:
        return None
    from smartspec.models.registry import resolve

    try:
        folder = Path(resolve(model, fetch_missing=False))
    except Exception:
        return None
    if not folder.exists():
        return None
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        size = path.stat().st_size
        digest.update(f"{path.relative_to(folder)}:{size}".encode())
        with path.open("rb") as f:
            for i in range(SAMPLED_BLOCKS):
                f.seek(size * i // SAMPLED_BLOCKS)
                digest.update(f.read(BLOCK_BYTES))
    return digest.hexdigest()[:16]


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
            "cuda_graphs": config.cuda_graphs and [config.max_cuda_graphs, config.max_num_seqs, config.max_model_len],
            "prefix_caching": config.enable_prefix_caching,
            "speculation": spec.as_dict() if spec else None,
            "batches": list(batches), "context": context, "device_name": device_name(config.device),
            "cores": os.cpu_count(), "step_code": step_code_digest(), "model_content": model_digest(config.model),
            "draft_content": model_digest(getattr(spec, "model", None)) if spec else None,
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


class KeptProfileCheck:
    """Holds a kept profile against the first steps it prices: `observe` each step's predicted and measured time;
    once `steps` steps without prefill are in, `stale` tells whether their median relative error passed `tolerance` (a
    profile kept from a faster or slower machine state, another build of the same versions)."""

    def __init__(self, path: Path, steps: int = 8, tolerance: float = 0.5) -> None:
        self.path, self.steps, self.tolerance = path, steps, tolerance
        self.errors: list[float] = []

    def observe(self, record: StepRecord) -> bool | None:
        """None while the check is still taking steps; then whether the kept profile is stale (once)."""
        if record.predicted_s is None or record.total_s <= 0 or record.num_prefill_tokens \
                or len(self.errors) >= self.steps:
            return None  # decoding steps alone: a prefill chunk's price is the fit's roughest
        self.errors.append(abs(record.predicted_s - record.total_s) / record.total_s)
        if len(self.errors) < self.steps:
            return None
        median = sorted(self.errors)[len(self.errors) // 2]
        if median <= self.tolerance:
            return False
        logger.warning("kept warm-up profile %s priced the first %d steps %.0f%% off (median): dropping it, to be "
                       "measured again once the engine is idle", self.path, self.steps, 100 * median)
        self.path.unlink(missing_ok=True)
        return True

