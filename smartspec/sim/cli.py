"""`smartspec sim`: latency vs rate per policy, simulated from measured traces; the serving benchmark's table and
plot, for what one machine cannot run (many replicas, high rates, another machine's cost profile)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from smartspec.bench.report import plot_latency_vs_rate, print_table, summarise
from smartspec.sim.profile import SimProfile
from smartspec.sim.simulator import Arrivals, ReplicaSize, simulate


def add_arguments(p) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", nargs="+", help="step traces measured with EngineConfig(trace_path=...): Parquet "
                     "files, or folders of parts (a server replica's <step_trace_dir>/<replica>)")
    src.add_argument("--profile", help="a profile saved with --save-profile")
    p.add_argument("--save-profile", help="write the fitted profile (JSON) here")
    p.add_argument("--policies", nargs="+", default=["off", "fixed:1", "fixed:3", "batch_table", "smartspec"])
    p.add_argument("--rates", nargs="+", type=float, default=[0.05, 0.15, 0.3])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=150)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--k-max", type=int, default=5)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", type=int, default=1, help="run every (rate, policy) with this many arrival schedules "
                   "(seeds --seed, --seed + 1, ...) and pool them: many short runs, like bench_policies', where one "
                   "long run at a high rate would only measure its queue")
    p.add_argument("--out", default="results/sim")


def run(args) -> int:
    if args.requests < 1 or args.replicas < 1 or args.seeds < 1 or any(r <= 0 for r in args.rates):
        print("smartspec sim: --requests, --replicas, --seeds and --rates must be positive", file=sys.stderr)
        return 2
    profile = SimProfile.from_traces(args.trace) if args.trace else SimProfile.load(args.profile)
    if args.save_profile:
        profile.save(args.save_profile)
    print(f"profile: {len(profile.alphas)} measured requests (mean acceptance "
          f"{np.mean(profile.alphas) if profile.alphas else 0:.2f}); cost {profile.source}", file=sys.stderr)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, summaries = [], []
    for rate in args.rates:
        for policy in args.policies:
            pooled, wall = [], 0.0
            for seed in range(args.seed, args.seed + args.seeds):
                gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=args.requests)
                requests = Arrivals(np.cumsum(gaps).tolist(), [args.prompt_len] * args.requests, args.max_tokens)
                result = simulate(profile, policy, args.k_max, requests, replicas=args.replicas, seed=seed,
                                  size=ReplicaSize(max_num_seqs=args.max_num_seqs))
                wall += max(r["arrival_s"] + r["latency_s"] for r in result)
                pooled += [{**r, "label": policy, "rate": rate, "replicas": args.replicas, "seed": seed}
                           for r in result]
            summaries.append(summarise(pooled, policy, rate, wall))
            rows += pooled
            print(f"\rsimulated {len(summaries)}/{len(args.rates) * len(args.policies)}", end="", file=sys.stderr)
    print(file=sys.stderr)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), out / "sim.parquet")
    pq.write_table(pa.Table.from_pylist(summaries), out / "sim_summary.parquet")
    try:
        plot_latency_vs_rate(summaries, out / "sim_latency_vs_rate.png", f"simulated, {args.replicas} replica(s)")
    except ModuleNotFoundError as e:  # the table and Parquet do not need the plotting extra
        print(f"smartspec sim: no plot ({e.name} is not installed: pip install -e '.[bench]')", file=sys.stderr)
    print_table(summaries)
    return 0
