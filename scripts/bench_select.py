"""Per-step cost of the SmartSpec policy's k selection (select_k with a fitted cost model), by batch size.

    python scripts/bench_select.py            # prints a table; writes results/bench_select.parquet
"""
from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

from smartspec.policy.cost_model import StepCostModel
from smartspec.policy.goodput import select_k


def main() -> int:
    rng = random.Random(0)
    model = StepCostModel()
    for _ in range(64):  # a fitted model shaped like the CPU measurements (flat to ~8 rows, then rising)
        n, c = rng.randint(1, 256), rng.randint(100, 20000)
        depth = rng.randint(0, 5)
        model.observe(n, c, depth, depth * 2, 0.1 * depth, 0.25 + 0.012 * max(0, n - 8) + 2e-6 * c)
    rows = []
    for batch in (1, 8, 32, 64, 128, 256):
        for k_max in (5, 10):
            alphas = [rng.uniform(0.1, 0.95) for _ in range(batch)]
            samples = []
            for _ in range(50):
                t = time.perf_counter()
                select_k(alphas, [k_max] * batch, model.predict, batch, 500 * batch)
                samples.append(time.perf_counter() - t)
            rows.append({"batch": batch, "k_max": k_max, "median_ms": 1e3 * statistics.median(samples),
                         "p99_ms": 1e3 * sorted(samples)[int(0.99 * len(samples))]})
    print(f"{'batch':>6s} {'K':>3s} {'median ms':>10s} {'p99 ms':>8s}")
    for r in rows:
        print(f"{r['batch']:6d} {r['k_max']:3d} {r['median_ms']:10.3f} {r['p99_ms']:8.3f}")
    import pyarrow as pa
    import pyarrow.parquet as pq

    Path("results").mkdir(exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), "results/bench_select.parquet")
    return 0


if __name__ == "__main__":
    sys.exit(main())
