"""The warm-up profile kept on disk: an engine started again with the same configuration on the same machine takes
its predecessor's step costs instead of measuring them; another configuration measures its own."""
import json

import pytest

from smartspec import LLM
from smartspec.engine import llm_engine, profile_cache


@pytest.fixture
def kept_under(tmp_path, monkeypatch):
    """Profiles kept under tmp_path (the rest of the cache, compiled kernels among it, where it is)."""
    monkeypatch.setattr(profile_cache, "cache_root", lambda: tmp_path)
    return tmp_path


def test_a_second_engine_of_one_configuration_takes_the_kept_profile(tiny_qwen, kept_under, monkeypatch):
    tmp_path = kept_under
    spec = {"method": "ngram", "num_speculative_tokens": 3, "policy": "smartspec"}
    options = dict(num_kv_blocks=128, block_size=4, max_model_len=256, profile_cache=True)
    first = LLM(tiny_qwen, speculative_config=spec, **options).engine
    kept = list((tmp_path / "profiles").glob("*.json"))
    assert len(kept) == 1 and len(json.loads(kept[0].read_text())["records"]) > 0
    fit = first.speculation.policy.cost.v

    with monkeypatch.context() as patched:
        patched.setattr(llm_engine.LLMEngine, "profile_steps", lambda self, *a: pytest.fail("measured again"))
        second = LLM(tiny_qwen, speculative_config=spec, **options).engine
    assert second.speculation.policy.cost.v == fit  # the same records, the same fit
    assert second.speculation.policy.cost.v_prior is not None  # held as the prior, as a measured profile is

    LLM(tiny_qwen, speculative_config={**spec, "num_speculative_tokens": 2}, **options)  # another k_max
    assert len(list((tmp_path / "profiles").glob("*.json"))) == 2


def test_an_unreadable_kept_profile_is_measured_again(tiny_qwen, kept_under):
    tmp_path = kept_under
    spec = {"method": "ngram", "num_speculative_tokens": 3, "policy": "smartspec"}
    options = dict(num_kv_blocks=128, block_size=4, max_model_len=256, profile_cache=True)
    LLM(tiny_qwen, speculative_config=spec, **options)
    (kept,) = (tmp_path / "profiles").glob("*.json")
    kept.write_text("{not json")
    engine = LLM(tiny_qwen, speculative_config=spec, **options).engine
    assert engine.speculation.policy.cost.ready
    assert json.loads(kept.read_text())["records"]  # measured and kept again


def test_profile_cache_is_checked():
    from smartspec import EngineConfig
    with pytest.raises(ValueError, match="profile_cache"):
        EngineConfig(profile_cache="yes")


def test_a_profile_is_kept_per_kernel_source(tiny_qwen, monkeypatch):
    """A kernel changed in place (a pull without a version bump) runs at another speed: its steps are measured again,
    not priced from the old kernel's profile."""
    from smartspec import EngineConfig
    from smartspec.runtime import kernels

    config = EngineConfig(model=tiny_qwen)
    before = profile_cache.profile_path(config, (1, 4), 64)
    assert profile_cache.profile_path(config, (1, 4), 64) == before  # the key is stable
    monkeypatch.setattr(kernels, "source_digest", lambda: "another kernel")
    assert profile_cache.profile_path(config, (1, 4), 64) != before
    assert profile_cache.profile_path(EngineConfig(model=tiny_qwen, use_kernels=False), (1, 4), 64) != before
