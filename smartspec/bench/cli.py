"""`smartspec bench serve`: the serving load generator's command line (the generator itself, with its HTTP client,
is imported only when it runs: it needs the bench extra)."""
from __future__ import annotations

import argparse

from smartspec.bench.workloads import SERVING_WORKLOADS


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", required=True, help="the served model name")
    ap.add_argument("--label", required=True, help="name of this configuration in tables and plots")
    ap.add_argument("--workload", default="humaneval-chat", choices=SERVING_WORKLOADS)
    ap.add_argument("--rates", nargs="+", type=float, default=[0.1],
                    help="request rates (req/s); 0: a closed loop of --concurrency requests in flight, each sent when "
                         "one has finished")
    ap.add_argument("--concurrency", type=int, default=1, help="requests in flight at rate 0 (default 1)")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--ignore-eos", action="store_true", help="every request generates max_tokens")
    ap.add_argument("--max-k", type=int, default=None, help="SmartSpec only: cap each request's speculation")
    ap.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default="results/serving")


def run(args) -> int:
    from smartspec.bench.serve import run as run_serve

    return run_serve(args)
