"""The API key: with one configured, every route but /health (and /metrics, unless asked) answers 401 to a caller
without `Authorization: Bearer <key>`, before the body is read or a replica is asked; the OpenAI SDK's api_key is
that header."""
import httpx
import pytest
from ray import serve
from served import wait_ready

from deployments.control.config import AppConfig


def test_an_empty_key_is_refused_at_the_edge():
    with pytest.raises(ValueError, match="api_key"):
        AppConfig.model_validate({"api_key": ""})


def test_requests_without_the_key_get_401_and_health_stays_open(ray_serve, tiny_qwen):
    import openai

    from deployments.app import build_app

    args = {"model": tiny_qwen, "served_model_name": "tiny", "speculation": None, "kv_cache_gib": 0.01,
            "max_model_len": 256, "replica_num_cpus": 0.1, "num_threads": 1, "warmup_profile": False,
            "api_key": "sk-test-key"}
    serve.run(build_app(args), name="keyed", route_prefix="/keyed")
    base = f"{ray_serve}/keyed"
    try:
        wait_ready(base, timeout=180)
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sk-test-key"},
                        {"Authorization": "Basic sk-test-key"}):
            for path in ("/v1/completions", "/v1/chat/completions"):
                r = httpx.post(f"{base}{path}", json=body, headers=headers, timeout=60)
                assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (headers, r.text)
                assert r.json()["error"]["param"] == "authorization"
        garbage = httpx.post(f"{base}/v1/completions", content=b"\xff not json", timeout=60)
        assert garbage.status_code == 401  # the key is asked before the body is read
        for path in ("/v1/models", "/v1/smartspec/status"):
            assert httpx.get(f"{base}{path}", timeout=60).status_code == 401
        assert httpx.get(f"{base}/health", timeout=60).status_code == 200
        assert httpx.get(f"{base}/metrics", timeout=60).status_code == 200
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="sk-test-key", max_retries=0, timeout=120)
        assert client.models.list().data[0].id == "tiny"
        answer = client.completions.create(model="tiny", prompt="hi", max_tokens=2, temperature=0)
        assert answer.usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base}/v1", api_key="sk-other", max_retries=0).completions.create(
                model="tiny", prompt="hi", max_tokens=2)
    finally:
        serve.delete("keyed")
