"""The warm-up profile kept on disk: an engine started again with the same configuration on the same machine takes
its predecessor's step costs instead of measuring them; another configuration measures its own."""
import json

import pytest

from smartspec import LLM, SamplingParams
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


def test_a_profile_is_kept_per_device_name_step_code_and_model_content(tiny_qwen, tmp_path, monkeypatch):
    """The same configuration on another device, with changed step code, or with other weights under the same path
    (a model re-fetched or re-converted in place) measures its own profile."""
    import shutil

    from smartspec import EngineConfig

    model = tmp_path / "model"
    shutil.copytree(tiny_qwen, model)
    config = EngineConfig(model=str(model))
    before = profile_cache.profile_path(config, (1, 4), 64)
    with monkeypatch.context() as patched:
        patched.setattr(profile_cache, "device_name", lambda device: "another GPU")
        assert profile_cache.profile_path(config, (1, 4), 64) != before
    with monkeypatch.context() as patched:
        patched.setattr(profile_cache, "step_code_digest", lambda: "another build")
        assert profile_cache.profile_path(config, (1, 4), 64) != before
    (weights,) = model.glob("*.safetensors")
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte, where the digest samples
    weights.write_bytes(bytes(data))
    assert profile_cache.profile_path(config, (1, 4), 64) != before


def test_the_step_code_digest_reads_the_step_packages():
    first = profile_cache.step_code_digest()
    assert first == profile_cache.step_code_digest() and len(first) == 16


def check_of(tmp_path, predicted_over_measured: float):
    from smartspec.types.step_record import StepRecord

    path = tmp_path / "kept.json"
    path.write_text("{}")
    check = profile_cache.KeptProfileCheck(path, steps=4)
    record = StepRecord(step=1, batch_size=1, ks=[0], proposed=[0], accepted=[0], request_ids=["r"],
                        num_batched_tokens=1, num_prefill_tokens=0, num_context_tokens=1, draft_s=0.0,
                        verify_s=0.01, total_s=0.01, predicted_s=0.01 * predicted_over_measured)
    return path, [check.observe(record) for _ in range(6)]


def test_a_kept_profile_that_prices_the_first_steps_wrong_is_dropped(tmp_path):
    path, verdicts = check_of(tmp_path, 3.0)
    assert verdicts == [None, None, None, True, None, None] and not path.exists()
    path, verdicts = check_of(tmp_path, 1.2)
    assert verdicts == [None, None, None, False, None, None] and path.exists()


def test_a_stale_kept_profile_is_measured_again_when_the_engine_is_idle(tiny_qwen, kept_under, monkeypatch):
    tmp_path = kept_under
    spec = {"method": "ngram", "num_speculative_tokens": 3, "policy": "smartspec"}
    options = dict(num_kv_blocks=128, block_size=4, max_model_len=256, profile_cache=True)
    LLM(tiny_qwen, speculative_config=spec, **options)
    (kept,) = (tmp_path / "profiles").glob("*.json")
    stored = json.loads(kept.read_text())
    for record in stored["records"]:  # a profile taken while something else loaded the machine: 20x slow
        record["total_s"] *= 20
        record["verify_s"] *= 20
        record["draft_s"] *= 20
    kept.write_text(json.dumps(stored))
    llm = LLM(tiny_qwen, speculative_config=spec, **options)
    engine = llm.engine
    assert engine.kept_check is not None
    llm.generate(["abcabcabc abc", "hello world"], SamplingParams(max_tokens=12))
    assert engine.profile_due and not kept.exists()
    measured = []
    monkeypatch.setattr(llm_engine.LLMEngine, "profile_steps",
                        lambda self, *a: measured.append(True) or [])
    assert engine.measure_profile_if_due() and measured == [True] and not engine.profile_due
