"""Batch-invariant CPU kernels, compiled on first use for the machine they run on (cached by torch)."""
from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import time
from pathlib import Path

logger = logging.getLogger(__name__)
SOURCES = ("batch_invariant.cpp", "quant_linear.cpp", "q8_linear.cpp", "attention.cpp", "decoder_layer.cpp")
HEADERS = ("panel_gemm.h", "quant_linear.h", "vec_math.h")
_lock = threading.Lock()
_module = None
_failed: str | None = None
STALE_LOCK_S = 600  # a build takes about a minute; a lock this old was left by a process killed mid-build


def load():
    """Return the compiled extension, or None (with the reason logged once) when it cannot be built here."""
    global _module, _failed
    if _module is not None or _failed is not None:
        return _module
    with _lock:
        if _module is not None or _failed is not None:
            return _module
        if os.environ.get("SMARTSPEC_DISABLE_KERNELS") == "1":
            _failed = "disabled by SMARTSPEC_DISABLE_KERNELS=1"
            return None
        try:
            from torch.utils import cpp_extension

            here = Path(__file__).parent
            build_dir = Path(os.environ.get("SMARTSPEC_CACHE", Path.home() / ".cache" / "smartspec")) / "kernels"
            build_dir.mkdir(parents=True, exist_ok=True)
            _clear_stale_lock(build_dir / "lock")
            print("smartspec: loading CPU kernels (compiled once per machine, ~1 min)...", file=sys.stderr, flush=True)
            _module = cpp_extension.load(
                name="smartspec_kernels",
                sources=[str(here / name) for name in SOURCES],
                extra_cflags=["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir),
                verbose=False,
            )
        except Exception as exc:  # a missing compiler must degrade to the torch path, not fail serving
            _failed = f"{type(exc).__name__}: {exc}"
            logger.warning("smartspec CPU kernels unavailable, using the torch path: %s", _failed)
        return _module


def _clear_stale_lock(lock: Path) -> None:
    """torch waits for a build's lock file forever; one left by a killed build would hang every later start."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        logger.warning("removing a kernel build lock %.0f s old (%s): its build was interrupted", age, lock)
        lock.unlink(missing_ok=True)


def source_digest() -> str:
    """A digest of the kernels' sources: what a kept step-cost profile measured (engine/profile_cache.py)."""
    digest = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        digest.update((Path(__file__).parent / name).read_bytes())
    return digest.hexdigest()[:16]


def unavailable_reason() -> str | None:
    return _failed
