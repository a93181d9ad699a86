"""Latency vs request rate per proposer, on three workloads: Poisson arrivals fed straight into the engine (no Ray).

Workloads (smartspec.bench.workloads.proposer_prompts): "edit" (rewrite a HumanEval function: the answer copies
the prompt), "agent" (three tool outputs read again and again: answers repeat across requests), "chat" (prose about
a problem: little to copy). Methods, on the target Qwen2.5-Coder-1.5B: off (no speculation), and under the goodput
policy (smartspec): ngram (prompt lookup), draft_model (the 0.5B), suffix (suffix speculation), mixed (the draft
model or suffix speculation, chosen per request and step).

--repeats R runs every (method, rate) R times, back to back per rate and in reversed order on odd repeats, so a
drift of the box's speed falls on all methods alike; each (workload, method) keeps one policy for the whole run, as
a server would, and each run starts with empty prefix caches and an empty cache of finished outputs. Prints a table
per run and the bar (the mixed choice against the best single method, per workload and rate, pooled over repeats:
ratio of mean latencies with its standard error over repeats); writes <out>/bench_proposers.parquet (one row per
request), <out>/bench_proposers_summary.parquet (one row per run), <out>/bench_proposers_bar.md and
<out>/bench_proposers.png.

    python scripts/bench_proposers.py --rates 0.1 0.3 --requests 6 --max-tokens 64 --out results/proposers
    python scripts/bench_proposers.py --workloads edit --methods off suffix mixed --rates 0.2 --requests 3
    python scripts/bench_proposers.py --report results/run1 results/run2 --out results/pooled

Its figures: docs/benchmarks.md, "Proposers per workload"."""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from smartspec import EngineConfig
from smartspec.bench.engine_load import run_rate, summarize
from smartspec.bench.workloads import PROPOSER_WORKLOADS, proposer_prompts
from smartspec.engine.llm_engine import LLMEngine
from smartspec.engine.trace import StepTraceWriter
from smartspec.policy import make_policy
from smartspec.spec_decode.mixed import MixedProposer
from smartspec.spec_decode.ngram import NgramProposer
from smartspec.spec_decode.suffix import SuffixProposer

METHODS = ("off", "ngram", "draft_model", "suffix", "mixed")


def make_method(method: str, engine: LLMEngine, draft, k_max: int, suffix_k: int, key: str):
    """(proposer, policy, K) for a method; suffix and mixed get a fresh cache of finished outputs."""
    if method == "off":
        return draft, make_policy("off", k_max), k_max
    if method == "ngram":
        proposer, k = NgramProposer(4, 1), suffix_k
    elif method == "draft_model":
        proposer, k = draft, k_max
    elif method == "suffix":
        proposer, k = SuffixProposer(suffix_k), suffix_k
    else:
        proposer, k = MixedProposer(draft, SuffixProposer(suffix_k)), suffix_k
    return proposer, make_policy("smartspec", k, key=f"{method}:{key}"), k


def arguments() -> argparse.ArgumentParser:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--workloads", nargs="+", default=list(PROPOSER_WORKLOADS), choices=PROPOSER_WORKLOADS)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--rates", nargs="+", type=float, default=[0.1, 0.3], help="requests per second")
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k-max", type=int, default=5, help="K of the draft model")
    ap.add_argument("--suffix-k", type=int, default=16, help="K of the lookups (ngram, suffix; mixed)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default="results/proposers")
    ap.add_argument("--trace-dir", default=None,
                    help="write each run's step trace here (Parquet; the proposer per request in its methods column)")
    ap.add_argument("--report", nargs="+", metavar="DIR", default=None,
                    help="run nothing: pool the runs saved in these --out folders into one table and plot in --out")
    return ap


def main() -> int:
    ap = arguments()
    args = ap.parse_args()
    if args.report:
        return report(args.report, Path(args.out))
    if args.repeats < 1 or args.requests < 1 or args.max_tokens < 1 or min(args.rates) <= 0:
        ap.error("--repeats, --requests and --max-tokens must be at least 1, and every rate above 0")
    torch.set_num_threads(args.threads)
    print(f"loading {args.target} with the draft {args.draft}...", file=sys.stderr, flush=True)
    engine = LLMEngine(EngineConfig(
        model=args.target, kv_cache_gib=1.0, max_num_seqs=16, max_model_len=2048, max_num_batched_tokens=256,
        speculative_config={"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.suffix_k,
                            "policy": "off"}))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    requests, summary = [], []
    runs = Progress(len(args.workloads) * args.repeats * len(args.rates) * len(args.methods))
    for workload in args.workloads:
        rows, sums = run_workload(engine, workload, args, runs)
        requests += rows
        summary += sums
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(requests), out / "bench_proposers.parquet")
    pq.write_table(pa.Table.from_pylist(summary), out / "bench_proposers_summary.parquet")
    print(f"\n{'workload':8s} {'method':12s} {'rate':>5s} {'rep':>3s} {'mean s':>7s} {'p50 s':>6s} {'TTFT s':>7s} "
          f"{'TPOT s':>7s} {'accepted/drafted':>17s}")
    for s in summary:
        print(f"{s['workload']:8s} {s['method']:12s} {s['rate']:5.2f} {s['repeat'] + 1:3d} {s['mean_latency_s']:7.2f} "
              f"{s['p50_latency_s']:6.2f} {s['mean_ttft_s']:7.2f} {s['mean_tpot_s']:7.3f} "
              f"{s['accepted_tokens']:>8d}/{s['draft_tokens']:<8d}")
    write_bar(summary, out)
    return 0


class Progress:
    """Runs done of the whole plan, for the progress lines."""

    def __init__(self, total: int) -> None:
        self.total, self.done = total, 0

    def next(self) -> str:
        self.done += 1
        return f"[{self.done}/{self.total}]"


def run_workload(engine: LLMEngine, workload: str, args, runs: Progress) -> tuple[list[dict], list[dict]]:
    """Every method at every rate on one workload, repeated (each repeat in reverse order): rows per request and
    per run. Each method's policy is profiled once, as an engine's start would."""
    draft = engine.speculation.proposer
    prompts = proposer_prompts(workload, args.requests, engine.tokenizer)
    policies = {}
    for method in args.methods:
        _, policy, k = make_method(method, engine, draft, args.k_max, args.suffix_k, args.draft)
        if policy.wants_profile:
            engine.set_speculation(draft, policy, k)
            engine.profile_steps()
        policies[method] = policy
    requests, summary = [], []
    for repeat in range(args.repeats):
        for rate in args.rates:
            for method in args.methods[:: 1 if repeat % 2 == 0 else -1]:
                print(f"{runs.next()} {workload} {method} rate {rate} req/s, repeat {repeat + 1}/{args.repeats}",
                      file=sys.stderr, flush=True)
                proposer, _, k = make_method(method, engine, draft, args.k_max, args.suffix_k, args.draft)
                engine.set_speculation(proposer, policies[method], k)
                # every run reads its prompts afresh: a prefix cached by the run before would favour the later
                engine.blocks.reset_prefix_cache()
                draft.blocks.reset_prefix_cache()
                trace_path = None
                if args.trace_dir:
                    trace_path = Path(args.trace_dir) / f"{workload}_{method}@{rate}_r{repeat}.parquet"
                    engine.trace = StepTraceWriter(trace_path, method)
                steps, t0 = engine.stats.steps, time.monotonic()
                rows = run_rate(engine, prompts, rate, args.max_tokens, args.seed + repeat)
                wall = time.monotonic() - t0
                if engine.trace is not None:
                    engine.trace.close()
                    engine.trace = None
                m, tags = engine.speculation.metrics, dict(workload=workload, method=method, rate=rate, repeat=repeat)
                requests += [{**tags, **r} for r in rows]
                summary.append(dict(**tags, wall_s=wall, steps=engine.stats.steps - steps,
                                    draft_tokens=m.num_draft_tokens, accepted_tokens=m.num_accepted_tokens,
                                    throughput_tok_s=sum(r["output_tokens"] for r in rows) / wall,
                                    trace_path=str(trace_path) if trace_path else None, **summarize(rows)))
    return requests, summary


def write_bar(summary: list[dict], out: Path) -> None:
    bar = bar_table(summary)
    print("\n" + bar)
    (out / "bench_proposers_bar.md").write_text(bar + "\n")
    plot(summary, out / "bench_proposers.png")


def report(folders: list[str], out: Path) -> int:
    """The bar over several runs' saved summaries, as if they were the repeats of one run."""
    import pyarrow.parquet as pq

    summary = []
    for folder in folders:
        path = Path(folder) / "bench_proposers_summary.parquet"
        if not path.exists():
            print(f"no {path}: not a bench_proposers --out folder", file=sys.stderr)
            return 2
        summary += pq.read_table(path).to_pylist()
    out.mkdir(parents=True, exist_ok=True)
    write_bar(summary, out)
    return 0


def bar_table(summary: list[dict]) -> str:
    """Per workload and rate: each method's mean latency pooled over repeats, and mixed / the best single method
    (ratio of pooled means; its standard error from the per-repeat ratios when there are several repeats)."""
    methods = [m for m in METHODS if any(s["method"] == m for s in summary)]
    lines = ["| workload | rate | " + " | ".join(methods) + " | mixed / best single |",
             "| --- | --- | " + " | ".join("---" for _ in methods) + " | --- |"]
    for workload in dict.fromkeys(s["workload"] for s in summary):
        for rate in sorted({s["rate"] for s in summary if s["workload"] == workload}):
            runs = {m: [s for s in summary if s["workload"] == workload and s["rate"] == rate and s["method"] == m]
                    for m in methods}
            mean = {m: statistics.mean(s["mean_latency_s"] for s in r) for m, r in runs.items() if r}
            singles = {m: v for m, v in mean.items() if m != "mixed"}
            cell = "-"
            if "mixed" in mean and singles:
                best = min(singles, key=singles.get)
                cell = f"{mean['mixed'] / singles[best]:.2f}x of {best}"
                per_repeat = [a["mean_latency_s"] / b["mean_latency_s"] for a, b in zip(runs["mixed"], runs[best])]
                if len(per_repeat) > 1:
                    cell += f" (± {statistics.stdev(per_repeat) / len(per_repeat) ** 0.5:.2f})"
            lines.append(f"| {workload} | {rate:g} | " + " | ".join(f"{mean[m]:.2f} s" if m in mean else "-"
                                                               for m in methods) + f" | {cell} |")
    return "\n".join(lines)


def plot(summary: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(s["workload"] for s in summary))
    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 4), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        for method in METHODS:
            runs = [s for s in summary if s["workload"] == workload and s["method"] == method]
            rates = sorted({s["rate"] for s in runs})
            if rates:
                ax.plot(rates, [statistics.mean(s["mean_latency_s"] for s in runs if s["rate"] == r) for r in rates],
                        marker="o", label=method)
        ax.set(title=workload, xlabel="request rate (req/s)", ylabel="mean latency (s)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
