"""The simulator: the real scheduler and policies over a known cost model and known acceptance."""
import numpy as np
import pytest

from smartspec.policy.cost_model import StepCostModel
from smartspec.sim import Arrivals, ReplicaSize, SimProfile, simulate
from smartspec.sim.profile import trace_rows
from smartspec.sim.simulator import SimReplica


def _profile(alpha: float, draft_per_token: float = 0.002, catchup_per_token: float = 0.0) -> SimProfile:
    cost = StepCostModel()
    cost.v = [0.05, 0.001, 0.001, 0.001, 0.001, 0.001, 0.001, 1e-6]  # v0, six segment slopes, context
    cost.d = [0.01, draft_per_token, catchup_per_token]
    return SimProfile(cost, [alpha])


def test_every_request_finishes_with_its_length_and_frees_its_blocks():
    prof = _profile(0.7)
    arrivals = np.cumsum(np.random.default_rng(0).exponential(0.05, size=40)).tolist()
    lengths = [5 + i % 17 for i in range(40)]
    rows = simulate(prof, "smartspec", 4, Arrivals(arrivals, [30 + i for i in range(40)], lengths), replicas=3,
                    seed=1)
    assert sorted(r["request"] for r in rows) == sorted(f"s{i}" for i in range(40))
    assert {r["request"]: r["output_tokens"] for r in rows} == {f"s{i}": lengths[i] for i in range(40)}
    assert all(0 < r["ttft_s"] <= r["latency_s"] for r in rows)
    assert {r["replica"] for r in rows} == {0, 1, 2}

    rep = SimReplica(prof, "fixed:3", 3, np.random.default_rng(0), ReplicaSize(64, 16, 4, 64, 512))
    from smartspec.types.request import Request
    from smartspec.types.sampling_params import SamplingParams
    for i in range(6):
        rep.add(Request(f"r{i}", [1] * 40, SamplingParams(max_tokens=9, ignore_eos=True)))
    now = 0.0
    while rep.scheduler.has_unfinished():
        now = rep.step(now).end
    assert rep.blocks.num_free == rep.blocks.num_blocks


def test_the_goodput_policy_keeps_state_only_for_requests_still_running():
    """A step's record names the requests that finished in it, after they were released: their outcomes must not
    give them state again, or a replica keeps a row for every request it ever served."""
    from smartspec.types.request import Request
    from smartspec.types.sampling_params import SamplingParams
    rep = SimReplica(_profile(0.9), "smartspec", 4, np.random.default_rng(0), ReplicaSize(256, 16, 4, 64, 512))
    policy, now = rep.speculation.policy, 0.0
    for i in range(12):
        rep.add(Request(f"r{i}", [1] * 30, SamplingParams(max_tokens=5 + 3 * i, ignore_eos=True)))
    while rep.scheduler.has_unfinished():
        now = rep.step(now).end
        policy.acceptance.gains([], 1)  # outcomes are counted when estimates are next read
        running = {r.request_id for r in rep.scheduler.running}
        kept = {f"r{i}" for i in range(12) if any(f"r{i}" in state for state in (
            policy.acceptance.first.slots, policy.acceptance.later.slots, policy.exploration.due_at,
            policy.catchup.seen))}
        assert kept <= running, kept - running
    assert rep.speculation.metrics.num_draft_tokens > 0
    assert len(policy.acceptance.first.slots) == len(policy.acceptance.later.slots) == 0


def test_full_acceptance_makes_fixed_k_take_k_plus_one_tokens_a_step():
    # one request, acceptance 1: after the prefill step (1 token), each step yields K + 1 = 4 tokens
    rep = SimReplica(_profile(1.0), "fixed:3", 3, np.random.default_rng(0), ReplicaSize(64, 16, 4, 256, 512))
    from smartspec.types.request import Request
    from smartspec.types.sampling_params import SamplingParams
    rep.add(Request("r", [1] * 20, SamplingParams(max_tokens=21, ignore_eos=True)))
    now = 0.0
    while rep.scheduler.has_unfinished():
        now = rep.step(now).end
    assert rep.steps == 1 + 5  # 1 + 4 * 5 = 21 tokens
    assert rep.speculation.metrics.num_accepted_tokens == 15


def test_speculation_pays_at_low_load_with_good_acceptance_and_not_with_none():
    arrivals = [float(i) for i in range(8)]  # one at a time: light load
    good, bad = _profile(0.9), _profile(0.0)

    def mean_latency(prof, policy):
        return np.mean([r["latency_s"] for r in simulate(prof, policy, 4, Arrivals(arrivals, [50] * 8, 32), seed=0)])

    assert mean_latency(good, "fixed:4") < 0.6 * mean_latency(good, "off")
    assert mean_latency(bad, "fixed:4") > mean_latency(bad, "off")
    # the goodput policy follows: near the better of the two in both cases
    assert mean_latency(good, "smartspec") < 0.7 * mean_latency(good, "off")
    assert mean_latency(bad, "smartspec") <= 1.1 * mean_latency(bad, "off")


def test_smartspec_learns_a_good_draft_model_from_a_cold_start_one_request_at_a_time():
    # a draft whose catch-up on a 150-token prompt costs 0.6 s (12 plain steps), accepted 95% of the time; the
    # policy starts from a prior of 0.5 and must probe to learn better, then draft for every request
    prof = _profile(0.95, catchup_per_token=0.004)
    requests = Arrivals([100.0 * i for i in range(8)], [150] * 8, 64)  # each finishes long before the next comes
    mean = {policy: np.mean([r["latency_s"] for r in simulate(prof, policy, 5, requests, seed=0)[2:]])
            for policy in ("off", "fixed:5", "smartspec")}
    assert mean["smartspec"] < 0.75 * mean["off"] and mean["smartspec"] < 1.1 * mean["fixed:5"], mean



@pytest.mark.parametrize("rate", [0.3, 1.0])
def test_under_load_smartspec_stays_near_no_speculation_where_drafting_costs_more_than_it_adds(rate):
    # the draft model's costs as fitted on this CPU: verify flat up to 8 tokens, then ~0.013-0.026 s a token; a
    # draft forward 0.1 s; a catch-up 4.4 ms a token. All drafts accepted. At saturation the batch fills the flat
    # part with plain decodes, and a draft forward costs more than the tokens it adds; at 0.3 req/s drafting pays
    # while a request is alone, but a catch-up (0.66 s) pays back only if drafting lasts, and arrivals end it
    # (the code before arrival-aware catch-up and probes: +3.8% over off here)
    cost = StepCostModel()
    cost.v = [0.28, 0.0, 0.026, 0.0128, 0.0128, 0.0133, 0.0149, 0.0]
    cost.d = [0.10, 0.0, 0.0044]
    prof = SimProfile(cost, [1.0])
    mean = {}
    for policy in ("off", "fixed:5", "smartspec"):
        runs = []
        for seed in range(8):
            arrivals = np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, size=8)).tolist()
            runs += [r["latency_s"] for r in simulate(prof, policy, 5, Arrivals(arrivals, [150] * 8, 32), seed=seed)]
        mean[policy] = float(np.mean(runs))
    assert mean["fixed:5"] > 1.1 * mean["off"], mean
    assert mean["smartspec"] < 1.02 * mean["off"], mean

def test_simulation_is_deterministic_for_a_seed():
    args = (_profile(0.6), "smartspec", 4, Arrivals([0.1 * i for i in range(20)], [40] * 20, 16))
    assert simulate(*args, seed=3) == simulate(*args, seed=3)


def test_profile_from_a_measured_trace(tmp_path, tiny_qwen):
    from smartspec import EngineConfig, SamplingParams
    from smartspec.engine.llm_engine import LLMEngine

    trace = tmp_path / "trace.parquet"
    engine = LLMEngine(EngineConfig(model=tiny_qwen, num_kv_blocks=128, max_model_len=256, trace_path=str(trace),
                                    speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                        "policy": "fixed"}))
    for p in ("abcabcabcabc", "hello hello hello", "xyzxyzxyz"):
        engine.add_request(p, SamplingParams(max_tokens=24, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    engine.close()
    # the shapes, choices and acceptance are the engine's; the times are replaced by a known cost of the shape, so
    # the test does not depend on this machine's timing (a tiny model's steps are mostly noise)
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(trace)
    n = np.array(table["num_batched_tokens"].to_pylist(), dtype=float)
    c = np.array(table["num_context_tokens"].to_pylist(), dtype=float)
    draft = np.array([0.001 * sum(p) for p in table["proposed"].to_pylist()])
    total = 0.010 + 0.002 * np.minimum(n, 8) + 0.001 * np.maximum(n - 8, 0) + 1e-5 * c + draft
    table = table.set_column(table.schema.get_field_index("draft_s"), "draft_s", pa.array(draft))
    table = table.set_column(table.schema.get_field_index("total_s"), "total_s", pa.array(total))
    pq.write_table(table, trace)
    prof = SimProfile.from_traces([trace])
    assert prof.cost.ready and prof.alphas and all(0.0 <= a <= 1.0 for a in prof.alphas)
    assert prof.step_time(4, 100, 0, 0) == pytest.approx(0.010 + 0.008 + 0.001, rel=0.05)
    prof.save(tmp_path / "p.json")
    loaded = SimProfile.load(tmp_path / "p.json")
    assert loaded.step_time(4, 100, 2, 6) == pytest.approx(prof.step_time(4, 100, 2, 6))


def test_a_trace_folder_is_readable_while_the_engine_runs_and_complete_after(tmp_path, tiny_qwen):
    """A server replica's trace (EngineConfig(trace_path=<folder>)): part files, each whole when written."""
    import dataclasses

    import pyarrow.parquet as pq

    from smartspec import EngineConfig, SamplingParams
    from smartspec.engine.llm_engine import LLMEngine
    from smartspec.engine.trace import trace_schema
    from smartspec.types.step_record import StepRecord

    folder = tmp_path / "steps" / "replica-1"
    # fixed k = 1: how many steps the run takes must not hang on measured times, as smartspec's choices do
    engine = LLMEngine(EngineConfig(model=tiny_qwen, num_kv_blocks=128, max_model_len=256, trace_path=str(folder),
                                    speculative_config={"method": "ngram", "num_speculative_tokens": 1,
                                                        "policy": "fixed"}))
    engine.trace.flush_every, engine.trace.flush_interval_s = 4, float("inf")  # by count only: no timing
    for p in ("abcabcabcabc", "hello hello hello", "xyzxyzxyz"):
        engine.add_request(p, SamplingParams(max_tokens=24, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    steps = engine.num_steps
    assert steps > 8
    assert pq.read_table(folder).num_rows == steps // 4 * 4  # the parts written so far, with the engine still open
    engine.close()
    table = pq.read_table(folder)
    assert table.num_rows == steps and table["step"].to_pylist() == sorted(table["step"].to_pylist())
    assert table.schema.equals(trace_schema())
    fields = {f.name for f in dataclasses.fields(StepRecord)} - {"trees"}
    # a new StepRecord field needs a column (verified trees stay in memory, for the policy)
    assert set(trace_schema().names) == fields | {"time", "policy"}
    assert table["methods"].to_pylist() == [[]] * steps  # one proposer served every request
    # the simulator reads a folder like a file (what it fits on those steps hangs on their measured times)
    assert [r["step"] for r in trace_rows([folder])] == table["step"].to_pylist()


def test_step_work_of_a_trace_counts_what_the_engine_did(tmp_path, tiny_qwen):
    """sweep_serving's per-replica summary (smartspec.bench.report.step_work) read from a real engine's trace folder
    agrees with the steps the engine reported as it ran them."""
    import pyarrow.parquet as pq

    from smartspec import EngineConfig, SamplingParams
    from smartspec.bench.report import step_work
    from smartspec.engine.llm_engine import LLMEngine

    folder = tmp_path / "steps" / "replica-1"
    engine = LLMEngine(EngineConfig(model=tiny_qwen, num_kv_blocks=128, max_model_len=256, trace_path=str(folder),
                                    speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                        "policy": "fixed"}))
    for p in ("abcabcabcabc", "hello hello hello"):
        engine.add_request(p, SamplingParams(max_tokens=20, ignore_eos=True))
    records = []
    while engine.has_unfinished():
        engine.step()
        records.append(engine.last_step)
    engine.close()
    work = step_work(pq.read_table(folder).to_pylist())
    drafted = sum(sum(r.proposed) for r in records)
    assert drafted > 0  # prompt lookup found something to draft in these prompts
    assert (work["steps"], work["drafted"], work["accepted"]) == (len(records), drafted,
                                                                  sum(sum(r.accepted) for r in records))
    assert work["busy_s"] == pytest.approx(sum(r.total_s for r in records))
    assert work["forward_s"] == pytest.approx(sum(r.verify_s for r in records))
    assert 0 <= work["other_ms"] < work["busy_s"] * 1e3


def test_sim_command_pools_several_arrival_schedules(tmp_path, capsys):
    import argparse

    import pyarrow.parquet as pq

    from smartspec.sim.cli import add_arguments, run

    _profile(0.8).save(tmp_path / "profile.json")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    common = ["--profile", str(tmp_path / "profile.json"), "--policies", "off", "smartspec", "--rates", "0.5",
              "--requests", "3", "--max-tokens", "8", "--prompt-len", "20"]
    assert run(parser.parse_args([*common, "--seeds", "2", "--out", str(tmp_path / "two")])) == 0
    rows = pq.read_table(tmp_path / "two" / "sim.parquet").to_pylist()
    assert len(rows) == 2 * 2 * 3 and {r["seed"] for r in rows} == {0, 1}
    summary = pq.read_table(tmp_path / "two" / "sim_summary.parquet").to_pylist()
    assert [s["requests"] for s in summary] == [6, 6]
    # the pooled mean is the mean over both schedules, each as a run of its own would give
    assert run(parser.parse_args([*common, "--seed", "1", "--out", str(tmp_path / "one")])) == 0
    second = [r for r in pq.read_table(tmp_path / "one" / "sim.parquet").to_pylist() if r["label"] == "off"]
    pooled_second = [r for r in rows if r["label"] == "off" and r["seed"] == 1]
    assert [r["latency_s"] for r in second] == [r["latency_s"] for r in pooled_second]
    assert run(parser.parse_args([*common, "--seeds", "0"])) == 2
    assert "--seeds" in capsys.readouterr().err
