"""scripts/bench_host.py and its target stand-in (smartspec/bench/instant_runner.py): the stand-in is the model it
claims to be, speculation over it is lossless and drafts are accepted, and the benchmark's table, raw rows, plot
and last line. (Its figures are timings, which no test reads.)"""
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from smartspec.bench.instant_runner import InstantRunner
from smartspec.config import EngineConfig
from smartspec.engine.llm_engine import LLMEngine
from smartspec.types.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench_host  # noqa: E402


def outputs(engine: LLMEngine, prompts: list[str], params: SamplingParams) -> list[list[int]]:
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while len(done) < len(ids):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    engine.close()
    return [done[i] for i in ids]


def test_the_stand_in_continues_its_cycle_and_prompt_lookup_drafts_it_losslessly(tiny_qwen):
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    engine, _ = bench_host.engine_for(tiny_qwen, 4, "chain", 4, policy="off")
    text = [engine.tokenizer.decode(t) for t in outputs(engine, ["abcdefgh", "mnop", "zzz"], params)]
    cycle = "abcdefghijklmnop" * 3
    assert text == [cycle[8:28], cycle[:20], cycle[:20]]  # after p, a; after any other token, a
    prompts = ["abcdefghijklmnopabcdefgh", "mnopabcdefghijklmnopabcd"]  # prompt lookup finds what follows
    engine, _ = bench_host.engine_for(tiny_qwen, 4, "chain", 4, policy="off")
    plain, plain_steps = outputs(engine, prompts, params), engine.num_steps
    for drafts, policy in (("chain", "fixed"), ("tree", "fixed"), ("chain", "smartspec")):
        engine, _ = bench_host.engine_for(tiny_qwen, 4, drafts, 4, policy)
        steps_before = engine.num_steps
        assert outputs(engine, prompts, params) == plain, (drafts, policy)
        if policy == "fixed":  # every draft is accepted: 4 drafted tokens and the target's a step
            assert engine.num_steps - steps_before <= plain_steps / 2, drafts


def test_the_stand_in_refuses_a_cycle_outside_the_vocabulary(tiny_qwen):
    with pytest.raises(ValueError, match="cycle"):
        LLMEngine(EngineConfig(model=tiny_qwen, num_kv_blocks=64, quantization=None, use_kernels=False),
                  runner_factory=lambda loaded, blocks: InstantRunner(loaded.config.vocab_size, blocks, [10 ** 6]))


def test_bench_host_prints_its_stages_and_writes_them(tmp_path, capsys):
    assert bench_host.main(["--rows", "1", "8", "--steps", "3", "--out", str(tmp_path)]) == 0
    rows = pq.read_table(tmp_path / "stages.parquet").to_pylist()
    assert [(r["rows"], r["drafts"]) for r in rows] == [(1, "chain"), (1, "tree"), (8, "chain"), (8, "tree")]
    for r in rows:
        stages = [r[s] for s in (*bench_host.STAGES, "other")]
        assert min(stages) >= 0 and r["plan"] > 0 and r["commit"] > 0 and r["prepare inputs"] > 0
        assert sum(stages) == pytest.approx(r["host_ms"], rel=1e-6)
        assert r["mean_k"] > 0  # the mix's prompts are drafted for
        assert r["device_ops"] > 0
    assert (tmp_path / "host.png").stat().st_size > 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("host ms per step: 1 row ") and "; 8 rows " in last


def test_sampled_traffic_is_measured_and_its_device_operations_do_not_grow_per_request(tmp_path):
    """--sampled: every request sampled (top-p, top-k, unseeded) and drafting; the accept stage makes their
    probabilities and verdicts together, so eight requests cost far fewer than eight times one's device operations
    (per request, each still draws its uniforms and its token from its own generator)."""
    assert bench_host.main(["--rows", "1", "8", "--drafts", "chain", "--steps", "3", "--sampled",
                            "--out", str(tmp_path)]) == 0
    one, eight = pq.read_table(tmp_path / "stages.parquet").to_pylist()
    assert one["mix"] == eight["mix"] == "sampled" and one["mean_k"] > 0 and eight["mean_k"] > 0
    assert eight["device_ops"] < 4 * one["device_ops"]


def test_the_stage_clock_puts_the_engines_functions_back(tiny_qwen):
    from smartspec.engine import llm_engine

    before = {name: getattr(llm_engine, name) for name in bench_host.MODULE_STAGES}
    bench_host.measure(tiny_qwen, 2, "chain", 4, 2)
    assert {name: getattr(llm_engine, name) for name in bench_host.MODULE_STAGES} == before
