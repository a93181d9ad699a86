"""The goodput policy against the best fixed k in hindsight and a per-request oracle, in the realistic simulator
(docs/policy.md, "The policy against an oracle"): closed loops at each concurrency, on the step-cost surfaces of the
H200, the Intel Xeon and the AMD Zen 4 (smartspec/sim/surfaces.py), acceptance uniform or mixed per request.

    python scripts/bench_oracle.py                         # every cell, ~8 min on 2 cores
    python scripts/bench_oracle.py --surfaces zen4 --concurrency 1 4 --acceptance mixed

The policies run as served: steps noisy with stalls, the policy starting from a noisy warm-up profile at the
engine's shapes and its acceptance calibration, its own host time timed on this machine: its plan added before
each forward, its observing and planning ahead run beside the forward (engine/step_observer.py), added where they
outlast a GPU's forward and in full on a CPU (the table's `host ms` is all of it, `before forward` the plan). The oracle knows every request's acceptance and the exact costs, and plans in no time. Each policy of a
cell meets the same requests and the same draft outcomes (seeded per request), so each seed gives a paired ratio;
seeds are added to a cell (--min-seeds to --max-seeds) until both ratios' standard errors are under --target-se.
Prints a table and writes results/bench_oracle/{runs.parquet, cells.parquet, oracle.png}; the last line:
`cells N; smartspec/best-fixed min X median Y; smartspec/oracle min Z`."""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from smartspec.engine.profile import profile_batches
from smartspec.sim.closed_loop import closed_loop
from smartspec.sim.realism import Realism
from smartspec.sim.surfaces import SURFACES
from smartspec.sim.workload import Workload


def mean_se(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], float("inf")
    return statistics.fmean(values), statistics.stdev(values) / len(values) ** 0.5


def realism_of(surface, concurrency: int, host: str) -> Realism:
    # a padded runner profiles its row buckets up to the batch it serves (engine/profile.py profile_batches)
    return Realism(surface.noise, "measured" if host == "measured" else 0.0,
                   profile_batches(surface.padded, concurrency))


def run_cell(args, surface_name: str, acceptance: str, concurrency: int) -> tuple[list[dict], dict]:
    surface = SURFACES[surface_name]
    profile, workload = surface.profile(), Workload(acceptance)
    policies = ["off", *(f"fixed:{k}" for k in range(1, args.k + 1)), "smartspec", "oracle"]
    requests = concurrency * args.waves + args.extra_requests
    runs, per_seed = [], {}
    for seed in range(args.max_seeds):
        for policy in policies:
            realism = realism_of(surface, concurrency, "none" if policy == "oracle" else args.host)
            r = closed_loop(profile, policy, args.k, concurrency, requests, workload, realism, seed)
            runs.append({"surface": surface_name, "acceptance": acceptance, "concurrency": concurrency,
                         "policy": policy, "seed": seed, "tokens": r.tokens, "seconds": r.seconds,
                         "tok_per_s": r.tokens_per_s, "steps": r.steps, "mean_k": r.mean_k, "host_ms": 1e3 * r.host_s,
                         "plan_ms": 1e3 * r.plan_s})
            per_seed.setdefault(policy, []).append(r.tokens_per_s)
        if seed + 1 >= args.min_seeds:
            cell = summarise_cell(per_seed, args.k)
            if max(cell["vs_best_se"], cell["vs_oracle_se"]) < args.target_se:
                break
    cell = summarise_cell(per_seed, args.k)
    mean_k = statistics.fmean(r["mean_k"] for r in runs if r["policy"] == "smartspec")
    host, plan = (statistics.fmean(r[column] for r in runs if r["policy"] == "smartspec")
                  for column in ("host_ms", "plan_ms"))
    return runs, {"surface": surface_name, "acceptance": acceptance, "concurrency": concurrency, **cell,
                  "smartspec_mean_k": mean_k, "smartspec_host_ms": host,
                  "smartspec_plan_ms": plan}


def summarise_cell(per_seed: dict[str, list[float]], k: int) -> dict:
    """The best fixed k in hindsight (k = 0 is off) by mean throughput over the seeds; smartspec's paired ratios."""
    fixed = {0: per_seed["off"], **{j: per_seed[f"fixed:{j}"] for j in range(1, k + 1)}}
    best = max(fixed, key=lambda j: statistics.fmean(fixed[j]))
    ours = per_seed["smartspec"]
    vs_best = mean_se([a / b for a, b in zip(ours, fixed[best])])
    vs_oracle = mean_se([a / b for a, b in zip(ours, per_seed["oracle"])])
    vs_off = mean_se([a / b for a, b in zip(ours, per_seed["off"])])
    return {"seeds": len(ours), "off": statistics.fmean(per_seed["off"]), "best_k": best,
            "best_fixed": statistics.fmean(fixed[best]), "smartspec": statistics.fmean(ours),
            "oracle": statistics.fmean(per_seed["oracle"]), "vs_best": vs_best[0], "vs_best_se": vs_best[1],
            "vs_oracle": vs_oracle[0], "vs_oracle_se": vs_oracle[1], "vs_off": vs_off[0]}


def print_table(cells: list[dict]) -> None:
    print("| surface | acceptance | streams | seeds | off tok/s | best fixed (k) | smartspec | oracle | "
          "vs best fixed | vs oracle | vs off | mean k | host ms | before forward |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for c in cells:
        print(f"| {c['surface']} | {c['acceptance']} | {c['concurrency']} | {c['seeds']} | {c['off']:.1f} | "
              f"{c['best_fixed']:.1f} ({c['best_k']}) | {c['smartspec']:.1f} | {c['oracle']:.1f} | "
              f"{c['vs_best']:.3f} ± {c['vs_best_se']:.3f} | {c['vs_oracle']:.3f} ± {c['vs_oracle_se']:.3f} | "
              f"{c['vs_off']:.3f} | {c['smartspec_mean_k']:.2f} | {c['smartspec_host_ms']:.2f} | "
              f"{c['smartspec_plan_ms']:.2f} |")


def plot(cells: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    surfaces = list(dict.fromkeys(c["surface"] for c in cells))
    fig, axes = plt.subplots(1, len(surfaces), figsize=(5 * len(surfaces), 4), squeeze=False, sharey=True)
    for ax, surface in zip(axes[0], surfaces):
        for acceptance in dict.fromkeys(c["acceptance"] for c in cells):
            mine = sorted((c for c in cells if c["surface"] == surface and c["acceptance"] == acceptance),
                          key=lambda c: c["concurrency"])
            x = [c["concurrency"] for c in mine]
            ax.plot(x, [c["vs_best"] for c in mine], marker="o", label=f"{acceptance}: / best fixed k")
            ax.plot(x, [c["vs_oracle"] for c in mine], marker="x", linestyle="--", label=f"{acceptance}: / oracle")
        ax.axhline(0.98, color="grey", linewidth=0.8)
        ax.axhline(0.95, color="grey", linewidth=0.8, linestyle="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("streams (closed loop)")
        ax.set_title(surface)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("smartspec throughput ratio")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--surfaces", nargs="+", default=list(SURFACES), choices=list(SURFACES))
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16, 64, 256])
    ap.add_argument("--acceptance", nargs="+", default=["uniform", "mixed"], choices=["uniform", "mixed"])
    ap.add_argument("--k", type=int, default=5, help="K: the most any request drafts; fixed:1..K are run")
    ap.add_argument("--waves", type=int, default=4, help="requests per client (the first wave is not measured)")
    ap.add_argument("--extra-requests", type=int, default=12, help="requests beyond the waves (one stream's "
                    "runs need more than four requests)")
    ap.add_argument("--min-seeds", type=int, default=3)
    ap.add_argument("--max-seeds", type=int, default=12)
    ap.add_argument("--target-se", type=float, default=0.01, help="stop adding seeds once both ratios' SE is below")
    ap.add_argument("--host", choices=["measured", "none"], default="measured",
                    help="add the policy's measured planning and observing time to each step (none: the exact "
                         "simulator's view)")
    ap.add_argument("--out", default="results/bench_oracle")
    args = ap.parse_args()
    if args.k < 1 or min(args.concurrency) < 1 or not 1 <= args.min_seeds <= args.max_seeds or args.waves < 2:
        ap.error("--k, --concurrency and the seeds must be positive, --min-seeds <= --max-seeds, --waves >= 2")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs, cells = [], []
    grid = [(s, a, c) for s in args.surfaces for a in args.acceptance for c in args.concurrency]
    began = time.monotonic()
    for i, (surface, acceptance, concurrency) in enumerate(grid, start=1):
        cell_runs, cell = run_cell(args, surface, acceptance, concurrency)
        runs += cell_runs
        cells.append(cell)
        print(f"[{i}/{len(grid)}, {time.monotonic() - began:.0f} s] {surface} {acceptance} {concurrency} streams: "
              f"smartspec/best fixed {cell['vs_best']:.3f}, /oracle {cell['vs_oracle']:.3f} "
              f"({cell['seeds']} seeds)", file=sys.stderr, flush=True)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(runs), out / "runs.parquet")
    pq.write_table(pa.Table.from_pylist(cells), out / "cells.parquet")
    try:
        plot(cells, out / "oracle.png")
    except ModuleNotFoundError as e:
        print(f"bench_oracle: no plot ({e.name} is not installed: pip install -e '.[bench]')", file=sys.stderr)
    print_table(cells)
    vs_best = [c["vs_best"] for c in cells]
    print(f"cells {len(cells)}; smartspec/best-fixed min {min(vs_best):.3f} median {statistics.median(vs_best):.3f}; "
          f"smartspec/oracle min {min(c['vs_oracle'] for c in cells):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
