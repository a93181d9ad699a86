"""Latency vs request rate per speculation policy: Poisson arrivals fed straight into the engine (no Ray).

HumanEval prompts (chat template, the shortest problems first so a run fits in minutes on a CPU) go to the target
Qwen2.5-Coder-1.5B with each proposer (the 0.5B draft model, prompt lookup) and each policy: off, fixed 1/3/5,
batch_table, smartspec. Per rate: mean / p50 / p99 latency, TTFT, TPOT, throughput; and for smartspec the
policy's step-time prediction error. Latency counts from the scheduled arrival, so time spent waiting for a
running step is included.

--repeats R runs every (configuration, rate) R times. All configurations at one rate run back to back, and each
repeat reverses their order, so a drift in the box's speed (see smartspec/bench/box_speed.py: probed before every run,
logged to <out>/speed_probe.csv) falls on all of them alike. A smartspec policy lives for the whole run, as it
would in a server: it keeps learning across rates and repeats.

Prints a table per run and the bar (smartspec against the best fixed:K and off, pooled over repeats and
per repeat); writes <out>/bench_policies.parquet (one row per request), <out>/bench_policies_summary.parquet (one
row per run), <out>/bench_policies_bar.md and <out>/bench_policies.png (pooled means).

    python scripts/bench_policies.py                        # the full sweep (about an hour on 2 cores)
    python scripts/bench_policies.py --policies off fixed:1 fixed:3 fixed:5 smartspec --rates 0.08 0.15 0.3 \\
        --requests 8 --max-tokens 32 --repeats 2 --out results/policies5
    python scripts/bench_policies.py --rates 0.1 --requests 3 --max-tokens 16 --policies off smartspec
    python scripts/bench_policies.py --proposers draft_model draft_tree --tree 8:4:2 --policies off fixed:5 smartspec
    python scripts/bench_policies.py --report results/policies31 results/policies32 --out results/policies31-32
    python scripts/bench_policies.py --workload mixed --proposers draft_model --k-max 4 \\
        --policies off fixed:1 fixed:2 fixed:3 fixed:4 smartspec --rates 0.1 0.2 0.4 --requests 9 --repeats 2

With --trace-dir, the bar also comes at equal box speed: the per-repeat latency ratios fitted against how fast the
box ran the two runs' plain decode steps of the same batch size, read where those ran equally fast
(smartspec.bench.report.plain_forward_ratio, speed_adjusted).
Its figures: docs/benchmarks.md, "Latency against load"."""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from smartspec import EngineConfig
from smartspec.bench.box_speed import print_probe_spread, record_probe
from smartspec.bench.engine_load import run_rate, summarize
from smartspec.bench.workloads import humaneval_prompts, proposer_prompts
from smartspec.engine.llm_engine import LLMEngine
from smartspec.engine.trace import StepTraceWriter
from smartspec.policy import make_policy
from smartspec.policy.baselines import default_batch_table
from smartspec.spec_decode.config import SpeculativeConfig, TreeConfig
from smartspec.spec_decode.factory import make_proposer
from smartspec.spec_decode.ngram import NgramProposer

POLICIES = ["off", "fixed:1", "fixed:3", "fixed:5", "batch_table", "smartspec"]


def workload_prompts(workload: str, variant: str, n: int, tokenizer) -> list[str]:
    """n prompts: "humaneval", the shortest HumanEval problems (--variant's form); "mixed", in turn a HumanEval
    problem (code: the draft often agrees), prose about one (little the draft gets right) and an edit of one (the
    answer copies the prompt), so that acceptance differs from request to request and within a batch."""
    code = sorted(humaneval_prompts(variant, 164, tokenizer), key=lambda p: len(tokenizer(p).input_ids))
    if workload == "humaneval":
        return code[:n]
    kinds = (code, proposer_prompts("chat", n, tokenizer), proposer_prompts("edit", n, tokenizer))
    return [kinds[i % 3][i // 3] for i in range(n)]


def arguments() -> argparse.ArgumentParser:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--proposers", nargs="+", default=["draft_model", "ngram"],
                    choices=["draft_model", "ngram", "draft_tree", "ngram_tree"],
                    help="*_tree: token trees of --tree's shape; k (fixed:K, the policies' K) is then a node budget")
    ap.add_argument("--tree", default="8:4:2", help="NODES:DEPTH:BRANCHING for the *_tree proposers")
    ap.add_argument("--policies", nargs="+", default=POLICIES)
    ap.add_argument("--rates", nargs="+", type=float, default=[0.05, 0.15, 0.3], help="requests per second")
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--k-max", type=int, default=5)
    ap.add_argument("--variant", default="chat", choices=["raw", "chat"])
    ap.add_argument("--workload", default="humaneval", choices=["humaneval", "mixed"],
                    help="mixed: code, prose and edits in turn (workload_prompts)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1,
                    help="run every (configuration, rate) this many times, interleaved; tables pool the repeats")
    ap.add_argument("--out", default="results")
    ap.add_argument("--trace-dir", default=None, help="write each run's step trace (Parquet) here")
    ap.add_argument("--report", nargs="+", type=Path, default=None, metavar="DIR",
                    help="run nothing: pool the runs of these earlier --out folders and print the bar over all their "
                         "repeats (written to --out)")
    return ap


def main() -> int:
    ap = arguments()
    args = ap.parse_args()
    if args.report:
        return report(args.report, Path(args.out))
    if args.repeats < 1 or args.requests < 1 or args.max_tokens < 1 or min(args.rates) <= 0:
        ap.error("--repeats, --requests and --max-tokens must be at least 1, and every rate above 0")
    try:
        tree = TreeConfig(*(int(x) for x in args.tree.split(":")))
    except (TypeError, ValueError) as exc:
        ap.error(f"--tree {args.tree!r}: {exc}")
    torch.set_num_threads(args.threads)
    engine = LLMEngine(EngineConfig(
        model=args.target, kv_cache_gib=1.0, max_num_seqs=16, max_model_len=2048, max_num_batched_tokens=256,
        speculative_config={"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.k_max,
                            "policy": "off"}))
    configs = configurations(args, engine, tree)
    prompts = workload_prompts(args.workload, args.variant, args.requests, engine.tokenizer)
    warm_prefix_caches(engine, configs, prompts)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    requests, summary = run_all(engine, configs, prompts, args, out)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(requests), out / "bench_policies.parquet")
    pq.write_table(pa.Table.from_pylist(summary), out / "bench_policies_summary.parquet")
    print_runs(summary)
    write_bar(summary, out)
    print_probe_spread([out])
    _plot(summary, out / "bench_policies.png")
    return 0


def configurations(args, engine: LLMEngine, tree: TreeConfig) -> list[tuple]:
    """(label, proposer, policy name, policy, K) per configuration: one policy object for the whole run, a
    learning one given what an engine's start gives it (LLMEngine.warm_up_profile: the step profile and the
    acceptance calibration)."""
    proposers = {"draft_model": engine.speculation.proposer, "ngram": NgramProposer(4, 1)}
    for name in ("ngram_tree", "draft_tree"):
        if name in args.proposers:
            method = "ngram" if name == "ngram_tree" else "draft_model"
            spec = SpeculativeConfig(method=method, model=args.draft if method == "draft_model" else None,
                                     policy="off", tree=tree)
            proposers[name] = make_proposer(spec, engine.draft_runtime(engine.speculation.proposer.blocks.num_blocks))
    configs = []
    for proposer_name in args.proposers:
        for policy_name in args.policies:
            if policy_name == "off" and proposer_name != args.proposers[0]:
                continue  # off never runs a proposer: measured once
            is_tree = proposer_name.endswith("_tree")
            k_max = tree.max_nodes if is_tree else args.k_max
            policy = make_policy(policy_name, k_max, default_batch_table(k_max), key=f"{proposer_name}:{args.draft}",
                                 tree_depth=tree.max_depth if is_tree else None)
            if policy.wants_profile:
                engine.set_speculation(proposers[proposer_name], policy, k_max)
                engine.warm_up_profile()
            label = "off" if policy_name == "off" else f"{proposer_name} {policy_name}"
            configs.append((label, proposers[proposer_name], proposer_name, policy_name, policy, k_max))
    return configs


def warm_prefix_caches(engine: LLMEngine, configs: list[tuple], prompts) -> None:
    """Every prompt read once, unmeasured, by the target and by each proposer's draft model (one token drafted). The
    configurations share the engine and the drafts, whose prefix caches keep the workload's prompts from one run to
    the next: without this the first configuration to run met them cold and every later one warm (the first at the
    first rate ran up to 2.8x slower than its own later repeats)."""
    warmed = set()
    for label, proposer, _, _, _, k_max in configs:
        if id(proposer) in warmed:
            continue
        warmed.add(id(proposer))
        print(f"warming the prefix caches with {label}'s proposer", file=sys.stderr, flush=True)
        engine.set_speculation(proposer, make_policy("fixed:1", k_max, default_batch_table(k_max)), k_max)
        run_rate(engine, prompts, 1000.0, 3, 0)  # the prompts at once; 3 tokens: the second step drafts one


def run_all(engine: LLMEngine, configs: list[tuple], prompts, args, out: Path) -> tuple[list[dict], list[dict]]:
    """Every configuration at every rate, repeated: the rows per request and per run."""
    requests, summary = [], []
    total, n = args.repeats * len(args.rates) * len(configs), 0
    for repeat in range(args.repeats):
        for rate in args.rates:
            # Every configuration at one rate runs back to back, and each repeat reverses the order (A B C, C B A):
            # the box's speed drifts over minutes, and this way a drift falls on all configurations alike.
            for label, proposer, proposer_name, policy_name, policy, k_max in configs[:: 1 if repeat % 2 == 0 else -1]:
                n += 1
                print(f"[{n}/{total}] {label} rate {rate} req/s, repeat {repeat + 1}/{args.repeats}",
                      file=sys.stderr, flush=True)
                probe = record_probe(out, f"{label}@{rate}#{repeat}")
                engine.set_speculation(proposer, policy, k_max)
                trace_path = None
                if args.trace_dir:  # every step of this run, for the simulator (smartspec sim --trace ...)
                    suffix = f"#{repeat}" if args.repeats > 1 else ""
                    trace_path = Path(args.trace_dir) / f"{label.replace(' ', '_')}@{rate}{suffix}.parquet"
                    engine.trace = StepTraceWriter(trace_path, policy.name)
                t0 = time.monotonic()
                rows = run_rate(engine, prompts, rate, args.max_tokens, args.seed)
                wall = time.monotonic() - t0
                if engine.trace is not None:
                    engine.trace.close()
                    engine.trace = None
                stats = getattr(policy, "stats", lambda: {})()
                tags = dict(config=label, proposer=proposer_name, policy=policy_name, rate=rate, repeat=repeat)
                requests += [{**tags, **r} for r in rows]
                summary.append(dict(**tags, wall_s=wall, throughput_tok_s=sum(r["output_tokens"] for r in rows) / wall,
                                    step_time_rel_error=stats.get("mean_relative_error"),
                                    probe_read_gb_s=probe["read_gb_s"], probe_matmul_gflop_s=probe["matmul_gflop_s"],
                                    trace_path=str(trace_path) if trace_path else None, **summarize(rows)))
    return requests, summary


def print_runs(summary: list[dict]) -> None:
    print(f"\n{'config':26s} {'rate':>5s} {'rep':>3s} {'mean s':>7s} {'p50 s':>6s} {'p99 s':>6s} {'TTFT s':>7s} "
          f"{'TPOT s':>7s} {'tok/s':>6s} {'pred err':>8s} {'GB/s':>5s}")
    for s in summary:
        err = f"{s['step_time_rel_error']:.1%}" if s["step_time_rel_error"] is not None else "-"
        print(f"{s['config']:26s} {s['rate']:5.2f} {s['repeat'] + 1:3d} {s['mean_latency_s']:7.2f} "
              f"{s['p50_latency_s']:6.2f} {s['p99_latency_s']:6.2f} {s['mean_ttft_s']:7.2f} {s['mean_tpot_s']:7.3f} "
              f"{s['throughput_tok_s']:6.2f} {err:>8s} {s['probe_read_gb_s']:5.1f}")


def write_bar(summary: list[dict], out: Path) -> None:
    """Print the bar's tables (and the box-adjusted one where the runs have traces) and save them as Markdown."""
    bar = bar_table(summary)
    adjusted = adjusted_table(summary)
    if adjusted:
        bar += ("\n\nPaired per repeat, raw and at equal box speed (the latency ratio where the two runs' plain "
                "forwards ran equally fast; slope: how the ratio followed their speed ratio):\n\n" + adjusted)
    print("\n" + bar)
    (out / "bench_policies_bar.md").write_text(bar + "\n")


def report(dirs: list[Path], out: Path) -> int:
    """Pool the runs of several bench_policies outputs (the same command run more than once): their repeats become
    one run's repeats, and the bar is read over all of them."""
    import pyarrow.parquet as pq

    summary = []
    for i, d in enumerate(dirs):
        path = d / "bench_policies_summary.parquet"
        if not path.exists():
            print(f"bench_policies: {path} not found", file=sys.stderr)
            return 2
        for row in pq.read_table(path).to_pylist():
            row["repeat"] = (i, row["repeat"])  # repeats stay paired within their own output
            if not row.get("trace_path"):  # outputs from before trace_path was recorded: the documented layout
                stem = d / "traces" / f"{row['config'].replace(' ', '_')}@{row['rate']}"
                found = [t for t in (Path(f"{stem}#{row['repeat'][1]}.parquet"), Path(f"{stem}.parquet")) if t.exists()]
                row["trace_path"] = str(found[0]) if found else None
            summary.append(row)
    out.mkdir(parents=True, exist_ok=True)
    write_bar(summary, out)
    return 0


def pooled(summary: list[dict]) -> dict[tuple[str, float], float]:
    """Mean latency per (config, rate) over all repeats (every repeat has the same requests)."""
    runs: dict[tuple[str, float], list[float]] = {}
    for s in summary:
        runs.setdefault((s["config"], s["rate"]), []).append(s["mean_latency_s"])
    return {key: statistics.mean(v) for key, v in runs.items()}


def best_fixed(means: dict[tuple[str, float], float], proposer: str, rate: float) -> str | None:
    """The proposer's fixed:K with the lowest pooled mean latency at this rate (None: the run has none)."""
    fixed = {c: v for (c, r), v in means.items() if r == rate and c.startswith(f"{proposer} fixed:")}
    return min(fixed, key=fixed.get) if fixed else None


def bar_table(summary: list[dict]) -> str:
    """The bar as a Markdown table: per proposer and rate, smartspec against the best fixed:K (by mean
    latency over all repeats) and against off; then the same ratio within each repeat, to show whether the
    ranking held in every repeat or only on average."""
    means = pooled(summary)
    per_run = {(s["config"], s["rate"], s["repeat"]): s["mean_latency_s"] for s in summary}
    repeats = sorted({s["repeat"] for s in summary})
    lines = ["| proposer | rate | smartspec s | best fixed s | off s | vs best fixed | vs off "
             "| per repeat (vs best fixed, else off) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for proposer in dict.fromkeys(s["proposer"] for s in summary if s["policy"] != "off"):
        for rate in dict.fromkeys(s["rate"] for s in summary):
            ours = means.get((f"{proposer} smartspec", rate))
            best = best_fixed(means, proposer, rate)
            off = means.get(("off", rate))
            if ours is None or not (best or off):
                continue
            # a run may leave out the fixed settings or off (a targeted rerun); its columns then read "-"
            ref = best or "off"  # per repeat: against the best fixed setting, or off where the run has none
            each = [per_run[(f"{proposer} smartspec", rate, k)] / per_run[(ref, rate, k)] - 1 for k in repeats
                    if (ref, rate, k) in per_run and (f"{proposer} smartspec", rate, k) in per_run]
            lines.append(f"| {proposer} | {rate:g} | {ours:.2f} | "
                         + (f"{means[(best, rate)]:.2f} ({best.split()[-1]}) | " if best else "- | ")
                         + (f"{off:.2f} | " if off else "- | ")
                         + (f"{ours / means[(best, rate)] - 1:+.1%} | " if best else "- | ")
                         + (f"{ours / off - 1:+.1%} | " if off else "- | ") + " / ".join(f"{e:+.1%}" for e in each)
                         + " |")
    return "\n".join(lines)


class Traces:
    """Each run's step trace, read once (None: a run without one)."""

    def __init__(self) -> None:
        self.read: dict[str, list[dict]] = {}

    def steps(self, run: dict) -> list[dict] | None:
        import pyarrow.parquet as pq

        path = run.get("trace_path")
        if not path or not Path(path).exists():
            return None
        if path not in self.read:
            self.read[path] = pq.read_table(path).to_pylist()
        return self.read[path]


def adjusted_table(summary: list[dict]) -> str:
    """Smartspec against off and the best fixed setting, pooled over repeats: the ratio of the pooled means, the
    geometric mean of the per-repeat ratios, and that ratio at equal box speed (smartspec.bench.report.speed_adjusted,
    on each repeat's plain-forward speed ratio from the two runs' step traces,
    smartspec.bench.report.plain_forward_ratio), with standard errors. Empty where no run has a trace."""
    traces = Traces()
    if not any(traces.steps(run) is not None for run in summary):
        return ""
    means = pooled(summary)
    lines = ["| proposer | rate | against | repeats | pooled means | geo. mean | at equal box speed (slope) | plain "
             "steps compared |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for proposer in dict.fromkeys(s["proposer"] for s in summary if s["policy"] != "off"):
        ours = f"{proposer} smartspec"
        for rate in dict.fromkeys(s["rate"] for s in summary):
            best = best_fixed(means, proposer, rate)
            for ref in ([best] if best else []) + (["off"] if ("off", rate) in means else []):
                row = adjusted_row(summary, traces, ours, ref, rate, means[(ours, rate)] / means[(ref, rate)])
                if row:
                    lines.append(f"| {proposer} | {rate:g} | {ref} | {row} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def adjusted_row(summary: list[dict], traces: Traces, ours: str, ref: str, rate: float,
                 pooled_ratio: float) -> str | None:
    """Ours against `ref` at one rate over the repeats both ran (None: none), as table cells: the repeats, the
    pooled means' ratio, the geometric mean, the ratio at equal box speed, the plain steps compared."""
    from smartspec.bench.report import paired_ratio, plain_forward_ratio, speed_adjusted

    runs = {(s["config"], s["rate"], s["repeat"]): s for s in summary}
    raw, paired, speeds, compared = [], [], [], 0
    for repeat in sorted({s["repeat"] for s in summary}):
        run, other = runs.get((ours, rate, repeat)), runs.get((ref, rate, repeat))
        if run is None or other is None:
            continue
        ratio = run["mean_latency_s"] / other["mean_latency_s"]
        raw.append(ratio)
        a, b = traces.steps(run), traces.steps(other)
        speed = plain_forward_ratio(a, b) if a is not None and b is not None else None
        if speed is not None:
            paired.append(ratio)
            speeds.append(speed[0])
            compared += speed[1]
    if not raw:
        return None
    g, g_se = paired_ratio(raw)
    adjusted = speed_adjusted(paired, speeds)
    # a repeat whose two runs share no plain batch size has no speed ratio and is left out: say how many
    at_speed = (f"{adjusted[0] - 1:+.1%} ± {adjusted[1]:.1%} ({adjusted[2]:.2f}; {len(paired)} of {len(raw)} repeats)"
                if adjusted else "-")
    return f"{len(raw)} | {pooled_ratio - 1:+.1%} | {g - 1:+.1%} ± {g_se:.1%} | {at_speed} | {compared}"


def _plot(summary, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    proposers = sorted({s["proposer"] for s in summary if s["policy"] != "off"})
    fig, axes = plt.subplots(1, len(proposers), figsize=(6 * len(proposers), 4.5), squeeze=False)
    means = pooled(summary)
    for ax, prop in zip(axes[0], proposers):
        for label in dict.fromkeys(s["config"] for s in summary if s["proposer"] == prop or s["policy"] == "off"):
            pts = sorted((rate, v) for (c, rate), v in means.items() if c == label)
            style = dict(lw=3, color="black") if "smartspec" in label else {}
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label, **style)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("mean request latency (s)")
        ax.set_title(f"target Qwen2.5-Coder-1.5B, proposer: {prop}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
