"""Resident memory of a running SmartSpec application, process by process, after some requests.

    serve run config.yaml &                    # then, once /health answers:
    python scripts/served_memory.py            # 4 chat requests of 128 tokens, then the table
    python scripts/served_memory.py --requests 0 --out results/memory-idle

Reads every Ray Serve process on this machine (the LLMServer replicas, their draft actors and tensor-parallel
workers, the HTTP front, the goodput controller, Serve's proxy and controller) from /proc: RSS now and its peak
(VmHWM, the most the process ever held). Prints a table, and writes memory.parquet and memory.png to --out. The
figure the docs quote for "the served pair" is the peak of the LLMServer process plus that of its draft actor,
if any. Its figures: docs/serving.md, "Options" (draft_actor's memory)."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import httpx
import pandas as pd

ROLES = {"ServeReplica:smartspec:LLMServer": "LLMServer", "DraftWorker": "draft actor", "TPWorker": "TP worker",
         "ServeReplica:smartspec:OpenAIIngress": "HTTP front", "ServeReplica:smartspec:GoodputController":
         "goodput controller", "ProxyActor": "Serve proxy", "ServeController": "Serve controller"}


def serve_processes() -> list[dict]:
    rows = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline") as f:
                cmd = f.read().replace("\0", " ")
            with open(f"/proc/{pid}/status") as f:
                status = {line.split(":")[0]: line.split()[1] for line in f if line.startswith(("VmRSS", "VmHWM"))}
        except OSError:  # gone meanwhile
            continue
        role = next((r for key, r in ROLES.items() if cmd.startswith(f"ray::{key}")), None)
        if role and "VmRSS" in status:
            rows.append({"role": role, "pid": int(pid), "rss_gib": int(status["VmRSS"]) / 2**20,
                         "peak_gib": int(status["VmHWM"]) / 2**20})
    return sorted(rows, key=lambda r: (list(ROLES.values()).index(r["role"]), r["pid"]))


def send_requests(url: str, model: str, n: int, max_tokens: int) -> None:
    for i in range(n):
        body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "messages": [
            {"role": "user", "content": f"Write a Python function that parses a CSV line with quotes ({i})."}]}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
        r.raise_for_status()
        print(f"  request {i + 1}/{n}: {r.json()['usage']['completion_tokens']} tokens", flush=True)


def plot(df: pd.DataFrame, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r.role}\n{r.pid}" for r in df.itertuples()]
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(df)), 4))
    ax.bar(labels, df.peak_gib, color="#c8d7ea", label="peak")
    ax.bar(labels, df.rss_gib, width=0.5, color="#2f5d8a", label="now")
    ax.set_ylabel("GiB resident")
    ax.legend()
    ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b", help="the served model name")
    ap.add_argument("--requests", type=int, default=4, help="chat requests sent first, one after another")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=Path("results/memory"))
    args = ap.parse_args()
    if args.requests < 0 or args.max_tokens < 1:
        ap.error("--requests must be >= 0 and --max-tokens >= 1")
    if args.requests:
        try:
            send_requests(args.url, args.model, args.requests, args.max_tokens)
        except httpx.HTTPError as exc:
            print(f"the requests to {args.url} failed ({exc!r}); is `serve run config.yaml` up and serving "
                  f"{args.model!r}?")
            return 1
    df = pd.DataFrame(serve_processes())
    if df.empty:
        print("no Ray Serve process of a SmartSpec application on this machine (is `serve run config.yaml` up?)")
        return 1
    print(df.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    pair = df[df.role.isin(["LLMServer", "draft actor"])]
    print(f"served pair (LLMServer + draft actors): {pair.peak_gib.sum():.2f} GiB at peak "
          f"({pair.peak_gib.sum() * 2**30 / 1e9:.2f} GB), {pair.rss_gib.sum():.2f} GiB now; "
          f"all Serve processes {df.rss_gib.sum():.2f} GiB now")
    args.out.mkdir(parents=True, exist_ok=True)
    df.to_parquet(args.out / "memory.parquet")
    plot(df, args.out / "memory.png")
    print(f"wrote {args.out / 'memory.parquet'} and {args.out / 'memory.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
