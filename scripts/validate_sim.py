"""Replay measured engine runs in the simulator and report the error of mean latency per (config, rate).

    python scripts/bench_policies.py --proposers ngram --policies off fixed:3 smartspec --rates 0.1 0.3 \
        --requests 8 --max-tokens 32 --trace-dir results/traces
    python scripts/validate_sim.py --results results --traces results/traces

The simulator gets the measured runs' prompt lengths, output lengths and arrival times (bench_policies' seeded
Poisson schedule), and per proposer a step-cost model fitted on its traces and those without speculation, with the
acceptance rates of its measured requests.
The simulator predicts one mean latency per (config, rate); the box does not repeat itself (two runs of one config
differ by 10-40% on this VM). So besides each run's error it reports the error against the mean of the repeats
(bench_policies --repeats), per (config, rate) and per rate, and the runs' own spread around that mean: the part
of the per-run error no simulator could remove.
Writes <results>/sim_validation.parquet and prints the tables. Its figures: docs/benchmarks.md, "Simulator"."""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from smartspec.sim import Arrivals, ReplicaSize, SimProfile, simulate

PROPOSERS = ("draft_model", "draft_tree", "ngram_tree", "ngram")


def profiles_by_proposer(traces: list[Path]) -> dict[str, SimProfile]:
    """One profile per proposer (its draft cost and acceptance are its own), each also fitted on the runs without
    speculation; bench_policies names traces '<proposer>_<policy>@<rate>' and 'off@<rate>'."""
    off = [t for t in traces if t.stem.startswith("off@")]
    of_proposer: dict[str, list[Path]] = {}
    for t in traces:
        name = next((p for p in PROPOSERS if t.stem.startswith(f"{p}_")), None)  # longest names first
        if name is not None:
            of_proposer.setdefault(name, []).append(t)
    profiles = {p: SimProfile.from_traces(off + ts) for p, ts in of_proposer.items()}
    if off:
        profiles["off"] = SimProfile.from_traces(off)
    return profiles


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default="results")
    ap.add_argument("--traces", default="results/traces")
    ap.add_argument("--k-max", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0, help="bench_policies' --seed")
    args = ap.parse_args()
    traces = sorted(Path(args.traces).glob("*.parquet"))
    if not traces:
        print(f"no traces in {args.traces}: run bench_policies.py with --trace-dir", file=sys.stderr)
        return 1
    profiles = profiles_by_proposer(traces)
    measured = pq.read_table(Path(args.results) / "bench_policies.parquet").to_pylist()
    out = []
    runs = sorted({(r["config"], r["policy"], r["rate"], r.get("repeat", 0)) for r in measured})
    for (config, policy, rate, repeat) in runs:  # each repeat of bench_policies --repeats is its own run
        rows = sorted((r for r in measured if r["config"] == config and r["rate"] == rate
                       and r.get("repeat", 0) == repeat), key=lambda r: int(r["request"][1:]))
        rng, t, arrivals = random.Random(args.seed), 0.0, []
        for _ in rows:  # bench_policies' schedule: exponential gaps from Random(seed)
            t += rng.expovariate(rate)
            arrivals.append(t)
        profile = profiles.get(config.split()[0] if config != "off" else "off")
        if profile is None:
            print(f"skipping {config} @ {rate}: no traces of its proposer in {args.traces}", file=sys.stderr)
            continue
        requests = Arrivals(arrivals, [r["prompt_tokens"] for r in rows], [r["output_tokens"] for r in rows])
        sim = simulate(profile, policy, args.k_max, requests, seed=args.seed,
                       size=ReplicaSize(max_num_seqs=16, max_model_len=2048))
        real, simulated = np.mean([r["latency_s"] for r in rows]), np.mean([r["latency_s"] for r in sim])
        out.append({"config": config, "rate": rate, "repeat": repeat, "measured_mean_latency_s": float(real),
                    "simulated_mean_latency_s": float(simulated), "rel_error": float(simulated / real - 1)})
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(out), Path(args.results) / "sim_validation.parquet")
    for name, profile in profiles.items():
        print(f"profile {name}: {len(profile.alphas)} requests, mean acceptance "
              f"{np.mean(profile.alphas) if profile.alphas else 0:.2f}, draft coefficients "
              f"{[round(d, 5) for d in profile.cost.d]}")
    print(f"{'config':24s} {'rate':>5s} {'rep':>3s} {'measured s':>10s} {'simulated s':>11s} {'error':>7s}")
    for r in out:
        print(f"{r['config']:24s} {r['rate']:5.2f} {r['repeat'] + 1:3d} {r['measured_mean_latency_s']:10.2f} "
              f"{r['simulated_mean_latency_s']:11.2f} {r['rel_error']:+7.1%}")
    print(f"mean |error| per run: {np.mean([abs(r['rel_error']) for r in out]):.1%}")
    print_error_against_repeat_means(out)
    return 0


def print_error_against_repeat_means(out: list[dict]) -> None:
    """The simulated mean against the mean of the measured repeats of one (config, rate), and how far the measured
    runs themselves lie from that mean."""
    points: dict[tuple[str, float], list[dict]] = {}
    for r in out:
        points.setdefault((r["config"], r["rate"]), []).append(r)
    if all(len(runs) == 1 for runs in points.values()):
        return
    errors, spreads = {}, {}
    print(f"\n{'config':24s} {'rate':>5s} {'runs':>4s} {'measured s':>10s} {'simulated s':>11s} {'error':>7s} "
          f"{'runs vs mean':>12s}")
    for (config, rate), runs in points.items():
        measured = np.mean([r["measured_mean_latency_s"] for r in runs])
        simulated = np.mean([r["simulated_mean_latency_s"] for r in runs])
        spread = np.mean([abs(r["measured_mean_latency_s"] / measured - 1) for r in runs])
        errors.setdefault(rate, []).append(abs(simulated / measured - 1))
        spreads.setdefault(rate, []).append(spread)
        print(f"{config:24s} {rate:5.2f} {len(runs):4d} {measured:10.2f} {simulated:11.2f} "
              f"{simulated / measured - 1:+7.1%} {spread:12.1%}")
    for rate in sorted(errors):
        print(f"rate {rate:g}: mean |error| against the repeats' mean {np.mean(errors[rate]):.1%} "
              f"(the runs' own mean |deviation| from it: {np.mean(spreads[rate]):.1%})")
    print(f"all rates: {np.mean([e for v in errors.values() for e in v]):.1%} "
          f"(runs' deviation {np.mean([s for v in spreads.values() for s in v]):.1%})")


if __name__ == "__main__":
    sys.exit(main())
