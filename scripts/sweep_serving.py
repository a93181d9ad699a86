"""The serving comparison: every configuration, ours and vLLM's, served one after the other on this machine and
driven by the same client (`smartspec bench serve`) with the same prompts, arrival times and output lengths.

    python scripts/sweep_serving.py --rates 0.05 0.1 0.2 --num-requests 6 --max-tokens 64 --out results/sweep

Configurations (--configs, default all):
  smartspec, batch_table          SmartSpec servers with that policy (config.yaml, K = --k)
  off, fixed:1, fixed:3, fixed:5  one SmartSpec server with policy fixed:K; each label caps k per request
                                  ("speculation": {"max_k": ...}), so k = 0 means no draft work at all
  fixed:7                          the same, on request only (not in the default set; needs --k 7)
  vllm-none, vllm-ngram, vllm-draft  scripts/vllm_peer.sh serve none|ngram|draft (install it first), vLLM's K = 4
  llama-none, llama-ngram, llama-draft  scripts/llama_peer.sh serve none|ngram|draft (install it first): llama.cpp
                                  on the same GGUF files, K = 8
Our configurations use config.yaml's draft model; --proposers ngram serves them with prompt lookup instead
(labels smartspec-ngram, fixed:5-ngram, ...), --proposers mixed with the draft model or suffix speculation per
request (`method: [draft_model, suffix]`, labels -mixed), --proposers draft_model ngram with each in turn.

Each server is started, waited for, measured and stopped before the next; the box must be otherwise idle, and
no other Ray may run on it (after each of our servers, `ray stop --force` clears the Ray that `serve run` started). Per
label, the client writes <out>/<label>.parquet and <out>/<label>_summary.parquet and redraws
<out>/latency_vs_rate.png, and each server's /metrics after its runs goes to <out>/metrics-<server>.txt. At the end
this prints mean latency per rate with each configuration's ratio to the best of the others, and writes the same
as a Markdown table to <out>/comparison.md.

The box's own speed is probed before each server starts and once at the end (memory bandwidth and matmul
throughput, ~1 s, to <out>/speed_probe.csv). A shared VM can slow by tens of percent within an hour; a spread
wider than 10% is flagged, since it is then larger than the differences the sweep is asked to resolve.
--cycles 2 serves the whole plan twice, the second time in reverse order (A B C, C B A), each cycle in
<out>/cycle-N, and the final table averages the cycles and lists each run, so a drift falls on all
configurations alike and shows as disagreement between the cycles. With --server-traces our servers keep step
traces, and the end of the run prints (and writes to <out>/steps.md) the work each replica did and where its time
went, to tell a gap in what the servers did from a gap in how fast the box ran them:

    python scripts/sweep_serving.py --configs smartspec fixed:5 vllm-ngram --proposers ngram --rates 0 0.1 \\
        --num-requests 5 --max-tokens 64 --cycles 2 --out results/sweep-v5

--rates 0 --concurrency 4 keeps four requests in flight (each sent when one finishes): aggregate throughput under
a steady load, the tok/s column of comparison.md. Its figures: docs/benchmarks.md, "Serving"."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import httpx

from smartspec.bench.box_speed import print_probe_spread, record_probe
from smartspec.bench.report import plot_latency_vs_rate, step_work
from smartspec.bench.servers import ROOT, ray_cli, start_server, stop_server

FIXED_LABELS = {"off": 0, "fixed:1": 1, "fixed:3": 3, "fixed:5": 5, "fixed:7": 7}
VLLM_LABELS = {"vllm-none": "none", "vllm-ngram": "ngram", "vllm-draft": "draft"}
LLAMA_LABELS = {"llama-none": "none", "llama-ngram": "ngram", "llama-draft": "draft"}


ALL = ["smartspec", "off", "fixed:1", "fixed:3", "fixed:5", "batch_table", *VLLM_LABELS, *LLAMA_LABELS]


def server_plan(configs: list[str], proposers: tuple[str, ...] = ("draft_model",)) \
        -> list[tuple[str, dict, list[tuple[str, int | None]]]]:
    """(server kind, its settings, [(label, max_k)]) in run order; the fixed labels share one server. Our
    servers are planned once per proposer; labels name it when it is not the draft model (smartspec-ngram)."""
    plan = []
    for proposer in proposers:
        tag = "" if proposer == "draft_model" else f"-{proposer}"
        if "smartspec" in configs:
            plan.append(("ours", {"policy": "smartspec", "method": proposer}, [(f"smartspec{tag}", None)]))
        # off (k = 0) runs no proposer at all, so its label names none
        fixed = [(label + ("" if label == "off" else tag), FIXED_LABELS[label])
                 for label in FIXED_LABELS if label in configs]
        if fixed:
            plan.append(("ours", {"policy": "fixed", "method": proposer}, fixed))
        if "batch_table" in configs:
            plan.append(("ours", {"policy": "batch_table", "method": proposer}, [(f"batch_table{tag}", None)]))
    plan += [("vllm", {"mode": VLLM_LABELS[c]}, [(c, None)]) for c in VLLM_LABELS if c in configs]
    plan += [("llama", {"mode": LLAMA_LABELS[c]}, [(c, None)]) for c in LLAMA_LABELS if c in configs]
    return plan


def bench(url: str, label: str, max_k: int | None, args, out: Path) -> int:
    cmd = [sys.executable, "-m", "smartspec.cli", "bench", "serve", "--url", url, "--model", args.model,
           "--label", label.replace(":", ""), "--workload", args.workload, "--rates", *map(str, args.rates),
           "--num-requests", str(args.num_requests), "--max-tokens", str(args.max_tokens), "--ignore-eos",
           "--seed", str(args.seed), "--concurrency", str(args.concurrency), "--out", str(out)]
    if max_k is not None:
        cmd += ["--max-k", str(max_k)]
    return subprocess.run(cmd, cwd=ROOT).returncode


def save_metrics(url: str, path: Path) -> None:
    """The server's /metrics after its runs (ours: chosen-k counts, goodput, prediction error; vLLM's own)."""
    try:
        path.write_text(httpx.get(f"{url}/metrics", timeout=30).text)
    except httpx.HTTPError as exc:
        print(f"  no /metrics: {exc!r}", flush=True)


def print_comparison(out: Path, sources: list[Path] | None = None, pool: bool = False) -> None:
    """Mean latency per configuration and rate, with the ratio to the best other configuration there; the same
    as a Markdown table (with TTFT, TPOT and acceptance) in <out>/comparison.md. sources: folders of earlier runs
    to merge: a later folder's (label, rate) replaces an earlier one's or, with pool, the runs of one (label,
    rate) are averaged (interleaved repeats; every run has the same requests). The plot is then redrawn in <out>."""
    import pandas as pd

    paths = [p for folder in (sources or [out]) for p in sorted(folder.glob("*_summary.parquet"))]
    if not paths:
        return
    runs = pd.concat([pd.read_parquet(p).assign(source=p.parent.name) for p in paths])
    if pool:
        print_runs(runs)
        counts = runs.groupby(["label", "rate"]).size().rename("runs")
        df = runs.groupby(["label", "rate"]).mean(numeric_only=True).join(counts).reset_index()
    else:
        df = runs.drop(columns="source").drop_duplicates(["label", "rate"], keep="last")
    if sources:
        out.mkdir(parents=True, exist_ok=True)
        df.to_parquet(out / "summary.parquet")
        plot_latency_vs_rate(df.to_dict("records"), out / "latency_vs_rate.png")
    table = df.pivot_table(index="label", columns="rate", values="latency_s_mean")
    ratio = table.copy()
    for rate in table.columns:
        for label in table.index:
            others = table[rate].drop(label).dropna()
            ratio.loc[label, rate] = table.loc[label, rate] / others.min() if len(others) else float("nan")
    print("\nmean latency (s); in brackets, the ratio to the best other configuration at that rate")
    for label in table.index:
        cells = [f"{table.loc[label, r]:8.2f} ({ratio.loc[label, r]:4.2f}x)" for r in table.columns]
        print(f"{label:>12}  " + "  ".join(cells))
    print(f"{'rates':>12}  " + "  ".join(f"{r:>17g}" for r in table.columns))
    lines = ["| configuration | rate (req/s) | mean latency s | vs best other | p99 s | TTFT s | TPOT s | tok/s | "
             "acceptance |", "|" + " --- |" * 9]
    for _, row in df.sort_values(["rate", "latency_s_mean"]).iterrows():
        acc = row.get("acceptance_rate")
        vs_best = ratio.loc[row.label, row.rate]
        cells = [row.label, f"{row.rate:g}", f"{row.latency_s_mean:.2f}", f"{vs_best:.2f}x", f"{row.latency_s_p99:.2f}",
                 f"{row.ttft_s_mean:.2f}", f"{row.tpot_s_mean:.3f}", f"{row.throughput_tok_s:.2f}",
                 "-" if pd.isna(acc) else f"{acc:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    (out / "comparison.md").write_text("\n".join(lines) + "\n")
    print_probe_spread(sources or [out])


def print_step_work(out: Path, folders: list[Path]) -> None:
    """Per replica of each of our servers that kept a step trace (--server-traces): the work it did and where its
    time went (smartspec.bench.report.step_work); the same as Markdown in <out>/steps.md. Two servers that drafted and
    accepted the same tokens in the same number of steps did the same work: a latency gap between them is then
    time per step, and forward_s against other_ms / between_steps_ms says whether the model or our code took it."""
    import pandas as pd
    import pyarrow.parquet as pq

    rows = []
    for folder in folders:
        for server in sorted(folder.glob("steps-*")):
            for replica in sorted(p for p in server.iterdir() if p.is_dir() and not p.name.startswith(".")):
                if not any(replica.glob("part-*.parquet")):
                    continue
                work = step_work(pq.read_table(replica).to_pylist())
                rows.append({"folder": folder.name, "server": server.name.removeprefix("steps-"),
                             "replica": replica.name, **work})
    if not rows:
        return
    df = pd.DataFrame(rows)
    print("\nstep traces: the work each replica did, and where its time went")
    print(df.round(2).to_string(index=False))
    lines = ["| " + " | ".join(df.columns) + " |", "|" + " --- |" * len(df.columns)]
    for row in df.itertuples(index=False):
        lines.append("| " + " | ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in row) + " |")
    out.mkdir(parents=True, exist_ok=True)
    (out / "steps.md").write_text("\n".join(lines) + "\n")


def print_runs(df) -> None:
    """Each run's mean latency, folder by folder: whether a ranking held in every repeat or only on average."""
    table = df.pivot_table(index=["label", "source"], columns="rate", values="latency_s_mean")
    print("\nmean latency (s) of each run")
    print(table.round(2).to_string())


def arguments() -> argparse.ArgumentParser:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=ALL, choices=[*ALL, "fixed:7"])
    ap.add_argument("--rates", nargs="+", type=float, default=[0.05, 0.1, 0.2])
    ap.add_argument("--num-requests", type=int, default=6)
    ap.add_argument("--concurrency", type=int, default=1,
                    help="requests in flight at rate 0 (a closed loop; tok/s in comparison.md is the aggregate)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--workload", default="humaneval-chat")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--k", type=int, default=5, help="our servers' K (num_speculative_tokens)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ready-timeout", type=float, default=900)
    ap.add_argument("--out", default="results/sweep")
    ap.add_argument("--proposers", nargs="+", default=["draft_model"], choices=["draft_model", "ngram", "mixed"],
                    help="our servers' proposers: the draft model of config.yaml, prompt lookup, and/or the draft "
                         "model or suffix speculation per request (labels get -ngram, -mixed); our configurations "
                         "are served once with each")
    ap.add_argument("--cycles", type=int, default=1,
                    help="serve the whole plan this many times, in reverse order every other cycle (A B C, C B A), "
                         "each cycle in <out>/cycle-N; the table then averages the cycles")
    ap.add_argument("--server-traces", action="store_true",
                    help="our servers write every step to steps-<server>/<replica>/part-*.parquet next to their "
                         "logs (step_trace_dir; for smartspec sim --trace or a look at single steps)")
    ap.add_argument("--no-warmup-profile", action="store_true",
                    help="our servers skip the warm-up profile at start (smartspec's cost model then starts from its "
                         "own steps); for telling the profile's effect on later forwards from the policy's")
    ap.add_argument("--report", nargs="+", type=Path, default=None, metavar="DIR",
                    help="run nothing: merge the summaries in these folders (rate 0 from one sweep, the other rates "
                         "from another) into --out's table, comparison.md and plot")
    ap.add_argument("--pool", action="store_true",
                    help="with --report: average the runs of one (label, rate) across the folders instead of keeping "
                         "the last (the cycles of --cycles, or separate sweeps run in turn)")
    return ap


def checked_args() -> argparse.Namespace:
    """The command line, each configuration's prerequisites checked (a usage error names what is missing)."""
    ap = arguments()
    args = ap.parse_args()
    if args.report:
        return args
    fixed_ks = [FIXED_LABELS[c] for c in args.configs if c in FIXED_LABELS]
    if fixed_ks and max(fixed_ks) > args.k:
        ap.error("--k must be at least the largest fixed:K asked for")
    if any(c in VLLM_LABELS for c in args.configs) and not (ROOT / ".venv-vllm").exists() \
            and "VLLM_VENV" not in os.environ:
        ap.error("vLLM configurations need scripts/vllm_peer.sh install first")
    if any(c in LLAMA_LABELS for c in args.configs) and not (ROOT / ".llama/bin/llama-server").exists() \
            and "LLAMA_DIR" not in os.environ:
        ap.error("llama.cpp configurations need scripts/llama_peer.sh install first")
    if args.cycles < 1:
        ap.error("--cycles must be at least 1")
    if any(kind == "ours" for kind, _, _ in server_plan(args.configs, tuple(args.proposers))) \
            and not (ray_cli("serve") and ray_cli("ray")):
        ap.error("our configurations need Ray Serve's `serve` and `ray` commands: pip install -e '.[serve]' "
                 "(or activate the virtualenv that has them)")
    return args


def main() -> int:
    args = checked_args()
    if args.report:
        print_comparison(Path(args.out), args.report, args.pool)
        print_step_work(Path(args.out), args.report)
        return 0
    out = Path(args.out)
    plan = server_plan(args.configs, tuple(args.proposers))
    folders = [out] if args.cycles == 1 else [out / f"cycle-{c + 1}" for c in range(args.cycles)]
    failed = []
    for cycle, folder in enumerate(folders):
        folder.mkdir(parents=True, exist_ok=True)
        # every other cycle runs the servers in reverse, so a drift in the box's speed falls on all of them alike
        for n, (kind, settings, labels) in enumerate(plan[:: -1 if cycle % 2 else 1], 1):
            print(f"[cycle {cycle + 1}/{len(folders)}, server {n}/{len(plan)}] {kind} {settings}: "
                  f"{', '.join(label for label, _ in labels)}", flush=True)
            failed += serve_and_drive(kind, settings, labels, args, folder)
        record_probe(folder, "end")
    if args.cycles == 1:
        print_comparison(out)
    else:
        print_comparison(out, folders, pool=True)
    print_step_work(out, folders)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def serve_and_drive(kind: str, settings: dict, labels: list[tuple[str, int | None]], args, folder: Path) -> list[str]:
    """One server started, driven for each of its labels, its metrics saved, stopped; the labels that failed."""
    name = "-".join(str(v) for v in settings.values())
    record_probe(folder, f"{kind}-{name}")
    try:
        proc, url = start_server(kind, settings, args, folder / f"server-{kind}-{name}.log")
    except Exception as exc:
        print(f"  could not start: {exc}", flush=True)
        return [label for label, _ in labels]
    failed = []
    try:
        for label, max_k in labels:
            if bench(url, label, max_k, args, folder):
                failed.append(label)
        save_metrics(url, folder / f"metrics-{kind}-{name}.txt")
    finally:
        stop_server(kind, proc)
    return failed


if __name__ == "__main__":
    sys.exit(main())
