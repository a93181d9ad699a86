"""Who else took the cores? Samples every process's CPU time from /proc while a benchmark runs (Linux only).

A server's forward slows when anything else on the box wants a core: on 2 cores a torch forward's two threads
then wait. Run this beside `sweep_serving.py`; every --every seconds it appends one JSON line: the time, and per
process its command line and CPU seconds; for Ray Serve replicas of LLMServer also per thread its CPU seconds,
seconds spent waiting for a core (/proc/PID/task/TID/schedstat) and time slices. Stop it with Ctrl-C.
`--report` then prints, for a window (say, one server's serving time, from its step traces' first and last
`time`), the processes that took the most CPU and each replica's busy threads:

    python scripts/sample_cpu.py --out results/cpu.jsonl &
    python scripts/sweep_serving.py ... ; kill %1
    python scripts/sample_cpu.py --report results/cpu.jsonl --from 1795412362 --to 1795412528
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter

TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_seconds(stat: str) -> float:
    fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def _threads(pid: str) -> dict[str, list[float]]:
    """tid -> [CPU s, waiting for a core s, time slices]."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            run_ns, wait_ns, slices = open(f"/proc/{pid}/task/{tid}/schedstat").read().split()
        except FileNotFoundError:  # a thread that ended since the listing; the process's sample still counts
            continue
        out[tid] = [int(run_ns) / 1e9, int(wait_ns) / 1e9, int(slices)]
    return out


def snapshot() -> dict:
    procs = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            command = open(f"/proc/{pid}/cmdline").read().replace("\0", " ").strip()[:100]
            entry = {"command": command, "cpu_s": _cpu_seconds(open(f"/proc/{pid}/stat").read())}
            if "LLMServer" in command:
                entry["threads"] = _threads(pid)
            procs[pid] = entry
        except (OSError, ValueError, IndexError):  # the process ended while being read
            continue
    return {"time": time.time(), "processes": procs}


def sample(path: str, every: float) -> None:
    with open(path, "a") as out:
        while True:
            out.write(json.dumps(snapshot()) + "\n")
            out.flush()
            time.sleep(every)


def report(path: str, start: float, end: float, top: int) -> None:
    snaps = [s for s in map(json.loads, open(path)) if start <= s["time"] <= end]
    if len(snaps) < 2:
        sys.exit(f"{path}: fewer than two samples between {start} and {end}")
    first, last = snaps[0]["processes"], snaps[-1]["processes"]
    span = snaps[-1]["time"] - snaps[0]["time"]
    used = Counter({pid: p["cpu_s"] - first[pid]["cpu_s"] for pid, p in last.items() if pid in first})
    print(f"{span:.0f} s window, {len(snaps)} samples; CPU seconds by process:")
    for pid, seconds in used.most_common(top):
        print(f"  {seconds:8.1f}  {pid:>7s}  {last[pid]['command'][:80]}")
        for tid, (run, wait, slices) in last[pid].get("threads", {}).items():
            before = first[pid].get("threads", {}).get(tid)
            if before and run - before[0] > 0.5:
                print(f"            thread {tid}: CPU {run - before[0]:.1f} s, waited for a core "
                      f"{wait - before[1]:.1f} s, {slices - before[2]} slices")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/cpu.jsonl", help="sample into this file (appends)")
    ap.add_argument("--every", type=float, default=5.0, help="seconds between samples")
    ap.add_argument("--report", metavar="FILE", help="run nothing: summarise FILE over --from .. --to")
    ap.add_argument("--from", dest="start", type=float, default=0.0, help="window start, Unix time")
    ap.add_argument("--to", dest="end", type=float, default=float("inf"), help="window end, Unix time")
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args()
    if not os.path.isdir("/proc/self/task"):
        ap.error("needs Linux's /proc")
    if args.every <= 0:
        ap.error("--every must be above 0")
    if args.report:
        report(args.report, args.start, args.end, args.top)
    else:
        try:
            sample(args.out, args.every)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
