"""The serving path alone (docs/benchmarks.md, "The serving path"): Serve's proxy, the ingress, the replica and the
wire, at the token rates a GPU produces, with an engine that emits tokens without a model
(smartspec/bench/paced_engine.py; `deployments.app:build_paced_app`).

    python scripts/bench_serving_path.py                      # 64 and 256 streams, ~10 min on 2 cores
    python scripts/bench_serving_path.py --streams 64 --steps-ms 40 20
    python scripts/bench_serving_path.py --channels on off    # with and without stream_channels, in turn
    python scripts/bench_serving_path.py --ingress proxy direct   # through Serve's proxy, then to the ingress itself
    python scripts/bench_serving_path.py --ingress haproxy        # HAProxy on the proxy's port, to the ingress

One Ray head (`ray start`), the application deployed per rate with `serve deploy` (the config `serve run` takes);
closed-loop streams of chat completions over HTTP/SSE, each `--max-tokens` long, sent to Serve's proxy or, with
`--ingress direct`, to the ingress replica's own HTTP server (Serve's direct ingress: docs/serving.md, "Direct
ingress"; its port read from Serve's controller after each deploy), or with `--ingress haproxy` to the HAProxy
that Serve's HAProxy mode runs on the proxy's port in front of the ingress replicas' own ports. Per point: the
tokens the clients received per second, the p99 gap between two tokens of a stream, and the CPU microseconds per
streamed token of Serve's processes (proxy, ingress, replica; the engine's own steps taken out), read from /proc.
A point holds when its p99 gap is under 50 ms and it delivers at least 90% of the offered rate. The clients run on
the same machine and take a share of its cores. Prints a table and writes
results/bench_serving_path/{points.parquet, gaps.png}; the last line: `us per streamed token X; rate held Y tok/s`
for the setting (interval, channels, ingress) that costs least (X: the median over its points; Y: the lowest, over
the stream counts, of the highest rate held), after a line for each."""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import psutil
import yaml

from smartspec.bench.servers import OURS_PORT, ROOT, ray_cli, ray_env

PORT = OURS_PORT
# Serve's direct ingress (RAY_SERVE_ENABLE_DIRECT_INGRESS): each ingress replica serves HTTP on a port of its own
# from this range; the proxy keeps PORT
DIRECT_PORTS = (PORT + 1, PORT + 11)
HOLD_GAP_S, HOLD_SHARE = 0.050, 0.9
# Serve's processes by role, by the actor class in a worker's title; Serve's HAProxy mode runs its proxy as a
# manager actor and the haproxy binary it starts, both counted as the proxy
SERVING = {"proxy": ("ProxyActor", "HAProxyManager"), "ingress": ("OpenAIIngress",), "replica": ("LLMServer",)}


def serve_config(streams: int, step_s: float, interval_ms: float, channels: bool = True) -> dict:
    # every stream's first request comes at once: Serve's queue holds them all while the router places them (at
    # the default 64, a direct ingress, which no proxy paces, turned 192 of 256 away)
    args = {"model": "paced", "served_model_name": "paced", "max_num_seqs": streams, "max_model_len": 4096,
            "max_ongoing_requests": 2 * streams, "max_queued_requests": 2 * streams, "max_waiting": 2 * streams,
            "paced_step_s": step_s, "stream_interval_ms": interval_ms, "stream_channels": channels,
            "replica_num_cpus": 0.5}
    return {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": PORT},
            "applications": [{"name": "smartspec", "route_prefix": "/",
                              "import_path": "deployments.app:build_paced_app", "args": args}]}


def deploy(streams: int, step_s: float, interval_ms: float, channels: bool, out: Path) -> None:
    """The application at this step interval, deployed and answering: Serve reports it running, on a replica
    started after this deploy (a change of args replaces the replica)."""
    path = out / "config.yaml"
    path.write_text(yaml.safe_dump(serve_config(streams, step_s, interval_ms, channels), sort_keys=False))
    deployed = time.time()
    subprocess.run([ray_cli("serve"), "deploy", str(path)], cwd=ROOT, env=ray_env(), check=True,
                   capture_output=True)
    while time.time() - deployed < 180:
        status = subprocess.run([ray_cli("serve"), "status"], cwd=ROOT, env=ray_env(), capture_output=True,
                                text=True).stdout
        app = (yaml.safe_load(status) or {}).get("applications", {}).get("smartspec", {})
        replicas = serving_processes().get("replica", [])
        if app.get("status") == "RUNNING" and replicas and all(p.create_time() >= deployed - 1 for p in replicas):
            return
        time.sleep(2)
    raise TimeoutError(f"the paced application at step_s={step_s} did not start within 180 s (serve status)")


def serving_processes() -> dict[str, list[psutil.Process]]:
    """Serve's processes by role, from their titles (Ray names a worker `ray::<actor class>...`)."""
    found: dict[str, list[psutil.Process]] = {}
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        title = " ".join(cmdline)
        if cmdline and Path(cmdline[0]).name == "haproxy":
            found.setdefault("proxy", []).append(proc)
        for role, markers in SERVING.items():
            if title.startswith("ray::") and any(marker in title for marker in markers):
                found.setdefault(role, []).append(proc)
    return found


def cpu_seconds(procs: dict[str, list[psutil.Process]]) -> dict[tuple[str, int], float]:
    """CPU seconds so far per (role, process id)."""
    out = {}
    for role, members in procs.items():
        for proc in members:
            try:
                t = proc.cpu_times()
                out[role, proc.pid] = t.user + t.system
            except psutil.NoSuchProcess:
                pass
    return out


def engine_busy_s(url: str) -> dict[str, float]:
    """Per replica, the paced engine's own step time so far (its steps' thread CPU), from the replicas' status
    (a replica of the last deployment may still be listed: only those in both readings are compared)."""
    status = httpx.get(f"{url}/v1/smartspec/status", timeout=60).json()
    return {rid: r.get("steps", {}).get("busy_s", 0.0) for rid, r in status.get("replicas", {}).items()
            if isinstance(r, dict)}


async def stream_one(client: httpx.AsyncClient, url: str, max_tokens: int, times: list[float],
                     tokens: list[int]) -> None:
    """One chat completion streamed to its end; each content chunk's arrival appended to times, its tokens (the
    paced engine's are one character each) to tokens."""
    body = {"model": "paced", "messages": [{"role": "user", "content": "go"}], "max_tokens": max_tokens,
            "stream": True}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
        async for line in resp.aiter_lines():
            if line.startswith("data: {") and '"content"' in line:
                choices = json.loads(line[6:])["choices"]
                times.append(time.perf_counter())
                tokens.append(len(choices[0]["delta"].get("content") or "") if choices else 0)


async def closed_loop(url: str, streams: int, max_tokens: int, warmup_s: float, window_s: float) -> dict:
    """`streams` clients of the server at `url`, each starting a new completion when its last ends; the tokens
    inside the window, and every stream's gaps between consecutive tokens within it."""
    times: list[list[float]] = [[] for _ in range(streams)]
    tokens: list[list[int]] = [[] for _ in range(streams)]
    limits = httpx.Limits(max_connections=streams + 8, max_keepalive_connections=streams + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as client:
        async def client_loop(i: int) -> None:
            while True:
                await stream_one(client, url, max_tokens, times[i], tokens[i])
                times[i].append(float("nan"))  # no gap across two completions
                tokens[i].append(0)

        began = time.perf_counter()
        window = (began + warmup_s, began + warmup_s + window_s)
        tasks = [asyncio.create_task(client_loop(i)) for i in range(streams)]
        await asyncio.sleep(warmup_s)
        marks = (cpu_seconds(serving_processes()), engine_busy_s(url), time.perf_counter())
        await asyncio.sleep(window_s)
        ends = (cpu_seconds(serving_processes()), engine_busy_s(url), time.perf_counter())
        for task in tasks:  # the streams still open are hung up on (their requests aborted)
            task.cancel()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    errors = [repr(e) for e in outcomes if not isinstance(e, asyncio.CancelledError)]
    return {"times": times, "tokens": tokens, "window": window, "marks": marks, "ends": ends, "errors": errors}


def summarise(streams: int, interval_ms: float, channels: bool, rate: float, run: dict) -> dict:
    lo, hi = run["window"]
    gaps, tokens = [], 0
    for ts, ns in zip(run["times"], run["tokens"]):
        arr = np.array(ts)
        inside = (arr >= lo) & (arr < hi)  # NaN (a completion's end) is neither
        tokens += int(np.array(ns)[inside].sum())
        d = np.diff(arr)
        both = inside[1:] & inside[:-1] & ~np.isnan(d)  # gaps within one completion, inside the window
        gaps.extend(d[both].tolist())
    (cpu0, busy0, t0), (cpu1, busy1, t1) = run["marks"], run["ends"]
    by_role = {role: sum(cpu1[key] - cpu0[key] for key in cpu0.keys() & cpu1.keys() if key[0] == role)
               for role in SERVING}  # processes that lived through the window
    engine_s = sum(busy1[rid] - busy0[rid] for rid in busy0.keys() & busy1.keys())
    outside = sum(by_role.values()) - engine_s
    delivered = tokens / (hi - lo)
    p99 = float(np.percentile(gaps, 99)) if gaps else float("inf")
    return {"streams": streams, "interval_ms": interval_ms, "channels": channels, "offered": rate,
            "delivered": delivered,
            "p99_gap_ms": 1e3 * p99,
            "median_gap_ms": 1e3 * statistics.median(gaps) if gaps else float("inf"),
            "us_per_token": 1e6 * outside / max(1, tokens), "engine_us_per_token": 1e6 * engine_s / max(1, tokens),
            **{f"{role}_us_per_token": 1e6 * v / max(1, tokens) for role, v in by_role.items()},
            "held": p99 < HOLD_GAP_S and delivered >= HOLD_SHARE * rate and not run["errors"],
            "errors": len(run["errors"]), "window_s": t1 - t0}


def run_point(streams: int, interval_ms: float, channels: bool, rate: float, ingress: str, args,
              out: Path) -> dict:
    step_s = streams / rate
    print(f"{streams} streams at {rate:.0f} tok/s (a step every {1e3 * step_s:.1f} ms), stream_interval_ms "
          f"{interval_ms:g}, channels {'on' if channels else 'off'}, through the {ingress} ingress: deploying",
          flush=True)
    deploy(streams, step_s, interval_ms, channels, out)
    url = direct_base_url() if ingress == "direct" else answering(f"http://127.0.0.1:{PORT}")
    run = asyncio.run(closed_loop(url, streams, args.max_tokens, args.warmup_s, args.window_s))
    row = {**summarise(streams, interval_ms, channels, rate, run), "ingress": ingress}
    print(f"  delivered {row['delivered']:.0f} tok/s, p99 gap {row['p99_gap_ms']:.1f} ms, "
          f"{row['us_per_token']:.0f} us a token outside the engine, {row['errors']} errors, "
          f"{'held' if row['held'] else 'not held'}",
          flush=True)
    return row


def print_table(rows: list[dict]) -> None:
    head = ("via", "streams", "interval ms", "channels", "offered", "delivered", "p99 gap ms", "us/token", "proxy",
            "ingress", "replica", "engine", "held")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        print(f"| {r['ingress']} | {r['streams']} | {r['interval_ms']:g} | {'on' if r['channels'] else 'off'} | "
              f"{r['offered']:.0f} | "
              f"{r['delivered']:.0f} | "
              f"{r['p99_gap_ms']:.1f} | "
              f"{r['us_per_token']:.0f} | {r['proxy_us_per_token']:.0f} | {r['ingress_us_per_token']:.0f} | "
              f"{r['replica_us_per_token']:.0f} | {r['engine_us_per_token']:.1f} | {'yes' if r['held'] else 'no'} |")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (gap, cpu) = plt.subplots(1, 2, figsize=(10, 5))
    for series in sorted({(r["streams"], r["interval_ms"], r["channels"], r["ingress"]) for r in rows}):
        mine = [r for r in rows if (r["streams"], r["interval_ms"], r["channels"], r["ingress"]) == series]
        label = (f"{series[0]} streams, interval {series[1]:g} ms, channels {'on' if series[2] else 'off'}, "
                 f"{series[3]} ingress")
        gap.plot([r["delivered"] for r in mine], [r["p99_gap_ms"] for r in mine], "o-", label=label)
        cpu.plot([r["delivered"] for r in mine], [r["us_per_token"] for r in mine], "o-", label=label)
    gap.axhline(1e3 * HOLD_GAP_S, color="grey", ls=":")
    gap.set(xlabel="tokens/s delivered", ylabel="p99 inter-token gap (ms)", yscale="log")
    cpu.set(xlabel="tokens/s delivered", ylabel="CPU us per streamed token, outside the engine")
    fig.legend(*cpu.get_legend_handles_labels(), loc="lower center", ncol=2, fontsize=7)
    fig.tight_layout(rect=(0, 0.2, 1, 1))  # the legend below both panels
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--steps-ms", type=float, nargs="+", default=[40, 20, 10],
                    help="the engine's step intervals (each emits a token to every stream), the offered rate being "
                         "streams / step (a step of 50 ms or more cannot hold: the gap is at least a step)")
    ap.add_argument("--stream-interval-ms", type=float, nargs="+", default=[0, 25],
                    help="the replica's stream_interval_ms: 0 sends a stream's tokens as they come")
    ap.add_argument("--channels", choices=["on", "off"], nargs="+", default=["on"],
                    help="stream_channels: a message a step for all streams (on), or one a stream (off)")
    ap.add_argument("--ingress", choices=["proxy", "direct", "haproxy"], nargs="+", default=["proxy"],
                    help="where the clients connect: Serve's proxy, the ingress replica itself (Serve's direct "
                         "ingress), or HAProxy on the proxy's port in front of it (Serve's HAProxy mode); each its "
                         "own Ray head, in turn")
    ap.add_argument("--max-tokens", type=int, default=256, help="tokens per completion")
    ap.add_argument("--warmup-s", type=float, default=8.0)
    ap.add_argument("--window-s", type=float, default=15.0)
    ap.add_argument("--out", default=str(ROOT / "results/bench_serving_path"))
    args = ap.parse_args()
    if min(args.streams) < 1 or min(args.steps_ms) <= 0 or args.max_tokens < 2 or args.window_s <= 0:
        ap.error("--streams, --steps-ms, --window-s must be positive and --max-tokens at least 2")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for ingress in args.ingress:  # Serve reads the direct-ingress flag as it starts: a Ray head for each
        subprocess.run([ray_cli("ray"), "start", "--head", "--num-cpus", "8", "--disable-usage-stats"], cwd=ROOT,
                       env=ingress_env(ingress), check=True, capture_output=True)
        try:
            for streams in args.streams:
                for interval_ms in args.stream_interval_ms:
                    for step_ms in sorted(args.steps_ms, reverse=True):
                        for channels in args.channels:  # in turn at each point: the box's drift falls on both
                            rows.append(run_point(streams, interval_ms, channels == "on", streams / (step_ms / 1e3),
                                                  ingress, args, out))
        finally:
            subprocess.run([ray_cli("serve"), "shutdown", "-y"], cwd=ROOT, env=ray_env(), capture_output=True)
            subprocess.run([ray_cli("ray"), "stop", "--force"], cwd=ROOT, env=ray_env(), capture_output=True)
    return report(rows, args, out)


def ingress_env(ingress: str) -> dict:
    """The environment the Ray head starts in: with `direct`, Serve's direct ingress on DIRECT_PORTS; with
    `haproxy`, that and HAProxy on PORT, which Serve keeps pointed at the ingress replicas' ports."""
    if ingress == "proxy":
        return ray_env()
    direct = {**ray_env(), "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
              "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(DIRECT_PORTS[0]),
              "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(DIRECT_PORTS[1])}
    return direct if ingress == "direct" else {**direct, "RAY_SERVE_ENABLE_HA_PROXY": "1"}


def answering(url: str, timeout_s: float = 60.0) -> str:
    """url, once its /health answers 200 (HAProxy learns of a new replica a moment after Serve reports it)."""
    began = time.time()
    while time.time() - began < timeout_s:
        try:
            if httpx.get(f"{url}/health", timeout=10).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url}/health did not answer within {timeout_s:.0f} s")


# Serve's controller knows where each ingress replica listens (its target groups, what a load balancer in front of
# direct ingress reads); asked from a driver of its own, as the bench drives Ray by its command line
_TARGETS = """
import json, ray
ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
from ray.serve.context import _get_global_client
groups = ray.get(_get_global_client()._controller.get_target_groups.remote("smartspec"))
print(json.dumps([t.port for g in groups if str(g.protocol).endswith("HTTP") for t in g.targets]))
"""


def direct_base_url(timeout_s: float = 60.0) -> str:
    """The URL of the one ingress replica's own HTTP server, once the controller lists it alone and it answers."""
    began = time.time()
    while time.time() - began < timeout_s:
        found = subprocess.run([sys.executable, "-c", _TARGETS], cwd=ROOT, env=ray_env(), capture_output=True,
                               text=True)
        ports = json.loads(found.stdout.strip().splitlines()[-1]) if found.returncode == 0 else []
        if len(ports) == 1 and DIRECT_PORTS[0] <= ports[0] <= DIRECT_PORTS[1]:
            try:
                return answering(f"http://127.0.0.1:{ports[0]}", timeout_s=10)
            except TimeoutError:
                pass
        time.sleep(2)
    raise TimeoutError(f"no ingress replica answered on its own port within {timeout_s:.0f} s")


def report(rows: list[dict], args, out: Path) -> int:
    import pandas as pd

    pd.DataFrame(rows).to_parquet(out / "points.parquet")
    plot(rows, out / "gaps.png")
    print_table(rows)
    lines = {}
    for setting in itertools.product(args.stream_interval_ms, args.channels, args.ingress):
        interval_ms, channels, ingress = setting
        mine = [r for r in rows if r["interval_ms"] == interval_ms and r["channels"] == (channels == "on")
                and r["ingress"] == ingress]
        held = [r["delivered"] for r in mine if r["held"]]
        per_streams = [max((r["delivered"] for r in mine if r["held"] and r["streams"] == s), default=0.0)
                       for s in args.streams]
        x = statistics.median(r["us_per_token"] for r in mine)
        line = lines[setting] = (x, f"us per streamed token {x:.0f}; rate held {min(per_streams):.0f} tok/s")
        print(f"stream_interval_ms {interval_ms:g}, channels {channels}, {ingress} ingress: {line[1]} ({len(held)} "
              f"of {len(mine)} points held)")
    print(min(lines.values())[1])  # the setting that costs least
    return 0


if __name__ == "__main__":
    sys.exit(main())
