"""Per-step cost of the SmartSpec policy, by batch size: the k selection alone (select_k with a fitted cost model),
and the policy's whole plan (the step's view built, acceptance estimates for the batch, caps, selection, probes),
cold (before 8 requests have finished, when each estimate averages over prior strengths) and warm, the same batch
step after step. Then the policy as an engine runs it (docs/benchmarks.md, "The policy's own cost"): an engine on
tiny random models (a target and a noisy copy as its draft, smartspec/bench/tiny_models.py) decodes 64 and 256
requests at once, and its step totals give the policy's planning and observing per step, batches changing as
requests finish; the median of ENGINE_RUNS runs at each size. One more run at each size keeps the policy's calls
and replays them on a fresh policy, one after another: the same work with the host's caches warm, where in the
engine each call follows a forward that filled them with the model (`replayed`: what the policy's own code costs).

    python scripts/bench_select.py            # prints both tables; writes results/bench_select.parquet and
                                              # results/bench_select_engine.parquet (every run)
"""
from __future__ import annotations

import dataclasses
import random
import statistics
import sys
import time
from pathlib import Path

from smartspec import SamplingParams
from smartspec.engine.planner import step_view
from smartspec.policy import GoodputPolicy
from smartspec.policy.cost_model import StepCostModel
from smartspec.policy.goodput import select_k
from smartspec.types.plan import RequestViews, SpecPlan, StepView
from smartspec.types.request import Request
from smartspec.types.step_record import StepRecord


def fitted(model: StepCostModel, rng: random.Random) -> None:
    """A fitted model shaped like the CPU measurements (flat to ~8 rows, then rising)."""
    for _ in range(64):
        n, c = rng.randint(1, 256), rng.randint(100, 20000)
        depth = rng.randint(0, 5)
        model.observe(n, c, depth, depth * 2, 0.1 * depth, 0.25 + 0.012 * max(0, n - 8) + 2e-6 * c)


def time_plan(batch: int, k_max: int, warm: bool, rng: random.Random) -> list[float]:
    policy = GoodputPolicy(key="bench")
    fitted(policy.cost, rng)
    if warm:  # enough finished requests for the prior's strength to be learned
        for i in range(10):
            for _ in range(12):
                policy.acceptance.observe(f"done{i}", k_max, rng.choice([k_max, k_max, 0, 3]))
            policy.acceptance.forget(f"done{i}")
    params = SamplingParams(max_tokens=256)
    requests = [Request(f"r{i}", list(range(500)), params) for i in range(batch)]
    for r in requests:
        for _ in range(3):
            policy.acceptance.observe(r.request_id, k_max, rng.choice([k_max, 0, 3]))
    samples = []
    for _ in range(50):
        t = time.perf_counter()
        policy.plan(step_view(requests, [], k_max))
        samples.append(time.perf_counter() - t)
    return samples


class RecordedPolicy(GoodputPolicy):
    """The goodput policy, each call an engine drafting chains makes kept with its arguments (a step's view with
    its columns read at the call, as the policy would read them) to be replayed. Trees' and lookups' calls (prune,
    observe_lookup_calibration) are not kept: this bench's engine makes none."""

    def __init__(self) -> None:
        super().__init__(key="bench")
        self.calls: list[tuple[str, tuple]] = []

    def plan(self, view: StepView) -> SpecPlan:
        self.calls.append(("plan", (kept_view(view),)))
        return super().plan(view)

    def plan_ahead(self, view: StepView) -> None:
        self.calls.append(("plan_ahead", (kept_view(view),)))
        super().plan_ahead(view)

    def observe(self, record: StepRecord) -> None:
        self.calls.append(("observe", (record,)))
        super().observe(record)

    def observe_profile(self, records: list[StepRecord]) -> None:
        self.calls.append(("observe_profile", (list(records),)))
        super().observe_profile(records)

    def observe_calibration(self, records: list[StepRecord]) -> None:
        self.calls.append(("observe_calibration", (list(records),)))
        super().observe_calibration(records)

    def release(self, request_id: str) -> None:
        self.calls.append(("release", (request_id,)))
        super().release(request_id)


def kept_view(view: StepView) -> StepView:
    """The view with every column read now (the engine's requests change after the step) and its clock set."""
    def kept(rows: RequestViews | None) -> RequestViews | None:
        if rows is None:
            return None
        columns, held = rows.columns(), rows.draft_held
        return RequestViews([], rows.ids, list(rows.num_tokens), lambda _: columns[2:], lambda _: held)
    return dataclasses.replace(view, requests=kept(view.requests), joining=kept(view.joining),
                               now=time.monotonic() if view.now is None else view.now)


def replayed(calls: list[tuple[str, tuple]]) -> tuple[float, GoodputPolicy]:
    """The recorded calls made again on a fresh policy, back to back: plan, plan ahead and observe in ms per step;
    and the policy they leave."""
    policy, spent = GoodputPolicy(key="bench"), 0.0
    for name, args in calls:
        began = time.perf_counter()
        getattr(policy, name)(*args)
        if name in ("plan", "plan_ahead", "observe"):
            spent += time.perf_counter() - began
    return 1e3 * spent / max(1, sum(name == "observe" for name, _ in calls)), policy


def engine_row(batch: int, k_max: int, target: str, draft: str, policy: GoodputPolicy | None = None) -> dict:
    """An engine with the goodput policy (or `policy`) serving `batch` requests at once, from the first step to
    the last."""
    from smartspec import LLM

    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": k_max,
            "policy": "smartspec" if policy is None else policy}
    llm = LLM(target, num_kv_blocks=max(16, batch * 12), block_size=16, max_model_len=256, max_num_seqs=batch,
              max_num_batched_tokens=batch * (k_max + 1) + 256, speculative_config=spec)
    prompts = [f"def f{i}(x):\n    return x + {i}\n" * 3 for i in range(batch)]
    llm.generate(prompts, [SamplingParams(max_tokens=64 + i % 64, ignore_eos=True) for i in range(batch)])
    steps = llm.engine.stats.snapshot()
    chosen = steps.chosen_k
    llm.engine.close()
    return {"batch": batch, "k_max": k_max, "steps": steps.steps, "policy_ms_per_step": steps.policy_ms_per_step,
            "mean_k": sum(k * n for k, n in chosen.items()) / max(1, sum(chosen.values()))}


ENGINE_RUNS = 5  # runs per batch size: how often the policy plans in full depends on the steps' measured times,
# so one run's figure moves by half from run to run; the median of five is the figure


def engine_rows() -> list[dict]:
    """Every run's row, ENGINE_RUNS at each batch size, interleaved (a drifting box slows each size alike)."""
    import tempfile

    from smartspec.bench.tiny_models import build_noisy_draft, build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        target = build_tiny_model(Path(tmp) / "target")
        draft = build_noisy_draft(Path(tmp) / "draft", target, noise=0.1)
        rows = [{**engine_row(batch, 5, target, draft), "run": run, "replayed_ms_per_step": None}
                for run in range(ENGINE_RUNS) for batch in (1, 64, 256)]
        for batch in (1, 64, 256):  # the recorded run's own time counts the recording: not a figure
            recorded = RecordedPolicy()
            row = engine_row(batch, 5, target, draft, recorded)
            rows.append({**row, "policy_ms_per_step": None, "run": ENGINE_RUNS,
                         "replayed_ms_per_step": replayed(recorded.calls)[0]})
        return rows


def engine_medians(rows: list[dict]) -> list[dict]:
    """Per batch size, the median run's policy time, its range, and the runs' steps and mean k."""
    out = []
    for batch in sorted({r["batch"] for r in rows}):
        runs = [r for r in rows if r["batch"] == batch and r["replayed_ms_per_step"] is None]
        times = sorted(r["policy_ms_per_step"] for r in runs)
        replayed = [r for r in rows if r["batch"] == batch and r["replayed_ms_per_step"] is not None]
        out.append({"batch": batch, "k_max": runs[0]["k_max"], "steps": statistics.median(r["steps"] for r in runs),
                    "policy_ms_per_step": statistics.median(times), "low": times[0], "high": times[-1],
                    "mean_k": statistics.mean(r["mean_k"] for r in runs),
                    "replayed_ms_per_step": replayed[0]["replayed_ms_per_step"] if replayed else float("nan")})
    return out


def timing_row(part: str, batch: int, k_max: int, samples: list[float]) -> dict:
    return {"part": part, "batch": batch, "k_max": k_max, "median_ms": 1e3 * statistics.median(samples),
            "p99_ms": 1e3 * sorted(samples)[int(0.99 * len(samples))]}


def main() -> int:
    rng = random.Random(0)
    model = StepCostModel()
    fitted(model, rng)
    rows = []
    for batch in (1, 8, 32, 64, 128, 256):
        for k_max in (5, 10):
            alphas = [rng.uniform(0.1, 0.95) for _ in range(batch)]
            samples = []
            for _ in range(50):
                t = time.perf_counter()
                select_k(alphas, [k_max] * batch, model.predict, batch, 500 * batch)
                samples.append(time.perf_counter() - t)
            rows.append(timing_row("select_k", batch, k_max, samples))
            for warm in (False, True):
                rows.append(timing_row(f"plan ({'warm' if warm else 'cold'})", batch, k_max,
                                       time_plan(batch, k_max, warm, rng)))
    print(f"{'part':>15s} {'batch':>6s} {'K':>3s} {'median ms':>10s} {'p99 ms':>8s}")
    for r in rows:
        print(f"{r['part']:>15s} {r['batch']:6d} {r['k_max']:3d} {r['median_ms']:10.3f} {r['p99_ms']:8.3f}")
    import pyarrow as pa
    import pyarrow.parquet as pq

    Path("results").mkdir(exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), "results/bench_select.parquet")
    engine = engine_rows()
    print(f"\n{'in the engine':>15s} {'batch':>6s} {'K':>3s} {'steps':>6s} {'policy ms/step':>15s} {'range':>13s} "
          f"{'mean k':>7s} {'replayed':>9s}   (median of {ENGINE_RUNS} runs; replayed: one more run's calls)")
    for r in engine_medians(engine):
        print(f"{'':>15s} {r['batch']:6d} {r['k_max']:3d} {r['steps']:6.0f} {r['policy_ms_per_step']:15.3f} "
              f"{r['low']:6.3f}-{r['high']:6.3f} {r['mean_k']:7.2f} {r['replayed_ms_per_step']:9.3f}")
    pq.write_table(pa.Table.from_pylist(engine), "results/bench_select_engine.parquet")
    return 0


if __name__ == "__main__":
    sys.exit(main())
