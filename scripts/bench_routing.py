"""Multi-replica serving on a two-node Ray cluster started on this machine: the goodput router against Serve's
default, a replica killed mid-run, and autoscaling from 1 to 2 replicas and back.

    python scripts/bench_routing.py                 # everything, ~10 min on 2 cores
    python scripts/bench_routing.py --parts kill    # one part: routing, kill, autoscale

It starts a head node and a second node (`ray start`, 2 logical CPUs each; replicas at most one per node), serves
the light bundled model (smollm2-135m, suffix speculation chosen by the goodput policy, max_num_seqs 4), and runs:

- routing: two applications side by side, `router: default` at /default and `router: goodput` at /goodput, two
  replicas each. Per cycle each gets a fresh workload of 8 conversations, each with its own ~1,000-token system
  prompt and 4 turns, interleaved turn by turn (turn t of all 8 at once, then turn t + 1). Prefix-cache hit rate
  from the servers' own counters (prompt tokens found in the cache / looked up), mean TTFT from the client;
  cycles alternate which router goes first, and the hit rates are pooled over the cycles.
- kill: 16 greedy requests (half streamed) on the goodput app, 8 per replica, 4 of them running and 4 waiting;
  once tokens flow, one replica's process gets SIGKILL. Each request is counted: completed, errored after its
  first token (a stream's error event), lost (anything else), duplicated (two answers: a second finish event, or
  usage over its max_tokens).
- autoscale: a third application with `autoscaling: {min_replicas: 1, max_replicas: 2, policy: goodput}` under a
  request rate that rises and then stops; its replica count once a second.

Prints a table per part; writes results/routing/bench_routing.json (every request, every count) and
bench_routing.png. Its last line: `hit-rate ratio R; completed C; errored after first token E; lost L;
duplicated D`. Everything it starts is stopped at the end. Needs the model fetched (`smartspec models fetch
smollm2-135m`) and ports 6390 and 8000 free.
Its figures: docs/benchmarks.md, "Several replicas"; docs/serving.md, "Several replicas"."""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

PORT, GCS = 8000, "127.0.0.1:6390"
# per replica, about 9,000 tokens of SmolLM2-135M's KV: two thirds of what a cycle's 8 conversations hold (~13,600
# tokens at their last turn). A replica that holds every conversation runs out and evicts; one that holds half
# of them does not. That is where it matters which replica holds a prefix.
KV_CACHE_GIB = 0.3
URL = f"http://127.0.0.1:{PORT}"
TOPICS = ["astronomy", "baking", "chess", "databases", "ecology", "finance", "geology", "harbors", "irrigation",
          "jazz", "knitting", "linguistics", "metallurgy", "navigation", "origami", "pottery"]
WORDS = ("always never first then check keep make sure write short clear answer question user detail step "
         "explain example simple careful polite tone format list number name date place reason result").split()


def ray_cli(*args: str) -> None:
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    subprocess.run([ray, *args], check=True, capture_output=True, text=True)


def app_config(model: str, router: str, **extra) -> dict:
    return {"model": model, "served_model_name": model, "router": router, "num_replicas": 2,
            "max_replicas_per_node": 1, "replica_num_cpus": 0.5, "num_threads": 1, "kv_cache_gib": KV_CACHE_GIB,
            "max_model_len": 4096, "max_num_seqs": 4, "controller_interval_s": 0.5,
            "speculation": {"method": "suffix", "num_speculative_tokens": 4, "policy": "smartspec"}, **extra}


def system_prompt(rng: random.Random, topic: str) -> str:
    """About 1,000 tokens of instructions, different for every conversation and cycle."""
    rules = [f"Rule {i} for the {topic} desk: " + " ".join(rng.choice(WORDS) for _ in range(14)) + "."
             for i in range(60)]
    return f"You are the {topic} assistant. " + " ".join(rules)


# ---- routing ---------------------------------------------------------------------------------------------------
def ask(base: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    """One turn, streamed: its TTFT, latency and answer."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0, ttft, text = time.monotonic(), None, ""
    with httpx.Client(timeout=600) as client, client.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
                if delta:
                    ttft = ttft or time.monotonic() - t0
                    text += delta
    return {"ttft_s": ttft, "latency_s": time.monotonic() - t0, "text": text}


def conversations(base: str, model: str, systems: dict[str, str], turns: int, max_tokens: int) -> list[dict]:
    """The conversations interleaved turn by turn: turn t of every conversation at once, then turn t + 1."""
    history = {topic: [{"role": "system", "content": system}] for topic, system in systems.items()}
    records = []
    with concurrent.futures.ThreadPoolExecutor(len(systems)) as pool:
        for turn in range(turns):
            for messages in history.values():
                messages.append({"role": "user", "content": f"Question {turn + 1}: give one tip."})
            answers = list(pool.map(lambda m: ask(base, model, m, max_tokens), history.values()))
            for (topic, messages), answer in zip(history.items(), answers):
                messages.append({"role": "assistant", "content": answer.pop("text")})
                records.append({"topic": topic, "turn": turn, **answer})
    return records


def cache_counts(base: str) -> dict[str, dict]:
    status = httpx.get(f"{base}/v1/smartspec/status", timeout=60).json()
    return {rid: dict(r.get("prefix_cache") or {}) for rid, r in status["replicas"].items()}


def settled_counts(base: str, previous: dict | None = None) -> dict[str, dict]:
    """The replicas' prefix-cache counters once two reports in a row agree (they report every 0.5 s)."""
    last = None
    for _ in range(40):
        counts = cache_counts(base)
        if counts == last and len(counts) == 2:
            return counts
        last = counts
        time.sleep(0.6)
    return last


def routing_run(model: str, router: str, cycle: int, args) -> dict:
    """One cycle's conversations against one router's application: prefix-cache hits, TTFT, the load per replica."""
    base = f"{URL}/{router}"
    rng = random.Random(f"{cycle}-{router}")
    systems = {t: system_prompt(rng, t) for t in rng.sample(TOPICS, args.conversations)}
    before = settled_counts(base)
    t0 = time.monotonic()
    records = conversations(base, model, systems, args.turns, args.max_tokens)
    wall = time.monotonic() - t0
    after = settled_counts(base)
    queries = sum(after[r].get("queries", 0) - before.get(r, {}).get("queries", 0) for r in after)
    hits = sum(after[r].get("hits", 0) - before.get(r, {}).get("hits", 0) for r in after)
    ttfts = [rec["ttft_s"] for rec in records if rec["ttft_s"] is not None]
    per_replica = {r: after[r].get("queries", 0) - before.get(r, {}).get("queries", 0) for r in after}
    costs = {rid: {k: r.get(k) for k in ("request_speed", "prefill_s_per_token")}
             for rid, r in httpx.get(f"{base}/v1/smartspec/status", timeout=60).json()["replicas"].items()}
    row = {"cycle": cycle, "router": router, "queries": queries, "hits": hits, "per_replica": per_replica,
           "costs": costs, "hit_rate": hits / queries if queries else 0.0, "mean_ttft_s": statistics.mean(ttfts),
           "requests": len(records), "wall_s": wall, "records": records}
    print(f"  cycle {cycle} {router:8s} hit rate {row['hit_rate']:.3f} ({hits}/{queries} prompt tokens), "
          f"mean TTFT {row['mean_ttft_s']:.3f} s, {row['requests']} requests in {wall:.0f} s; prompt tokens per "
          f"replica {sorted(per_replica.values())}", flush=True)
    return row


def run_routing(model: str, args, results: dict) -> None:
    from ray import serve

    from deployments.app import build_app

    t0 = time.monotonic()
    for router in ("default", "goodput"):
        serve.run(build_app(app_config(model, router)), name=router, route_prefix=f"/{router}", blocking=False)
    wait_ready([f"{URL}/default", f"{URL}/goodput"])
    print(f"routing: two applications of 2 replicas deployed in {time.monotonic() - t0:.0f} s", flush=True)
    rows = []
    for cycle in range(args.cycles):
        order = ("default", "goodput") if cycle % 2 == 0 else ("goodput", "default")
        for router in order:
            rows.append(routing_run(model, router, cycle, args))
    pooled = {}
    for router in ("default", "goodput"):
        mine = [r for r in rows if r["router"] == router]
        ttfts = [rec["ttft_s"] for r in mine for rec in r["records"]]
        pooled[router] = {"hit_rate": sum(r["hits"] for r in mine) / max(1, sum(r["queries"] for r in mine)),
                          "mean_ttft_s": statistics.mean(ttfts),
                          "ttft_se_s": statistics.stdev(ttfts) / len(ttfts) ** 0.5}
    ratio = pooled["goodput"]["hit_rate"] / pooled["default"]["hit_rate"] if pooled["default"]["hit_rate"] else None
    print(f"\n{'router':10s} {'hit rate':>9s} {'mean TTFT s':>12s} {'± SE':>7s}")
    for router, p in pooled.items():
        print(f"{router:10s} {p['hit_rate']:9.3f} {p['mean_ttft_s']:12.3f} {p['ttft_se_s']:7.3f}")
    print(f"hit-rate ratio (goodput / default, pooled over {args.cycles} cycles): "
          f"{'n/a' if ratio is None else f'{ratio:.2f}'}\n", flush=True)
    results["routing"] = {"rows": rows, "pooled": pooled, "hit_rate_ratio": ratio}
    serve.delete("default")


# ---- kill --------------------------------------------------------------------------------------------------------
def one_request(base: str, model: str, i: int, stream: bool, max_tokens: int, progress: dict) -> dict:
    """One greedy request and what its client saw."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"Request {i}: write a long story about {TOPICS[i % 16]}."}]}
    out = {"i": i, "stream": stream, "tokens": 0, "finishes": 0, "error": None, "done": False, "status": None}
    try:
        with httpx.Client(timeout=600) as client:
            if not stream:
                r = client.post(f"{base}/v1/chat/completions", json=body)
                out["status"] = r.status_code
                data = r.json()
                if r.status_code == 200:
                    out["finishes"] = sum(1 for c in data["choices"] if c.get("finish_reason"))
                    out["tokens"] = data["usage"]["completion_tokens"]
                    out["done"] = len(data["choices"]) == 1
                else:
                    out["error"] = data.get("error", {}).get("message")
                return out
            with client.stream("POST", f"{base}/v1/chat/completions",
                               json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
                out["status"] = r.status_code
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        out["done"] = True
                    elif line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            out["error"] = chunk["error"]["message"]
                        elif chunk.get("usage"):
                            out["billed"] = chunk["usage"]["completion_tokens"]
                        for c in chunk.get("choices", []):
                            out["tokens"] += 1 if c["delta"].get("content") else 0
                            out["finishes"] += 1 if c.get("finish_reason") else 0
                            if c["delta"].get("content"):
                                progress["streamed"] = progress.get("streamed", 0) + 1
    except Exception as exc:  # the client saw no answer
        out["error"] = f"client: {exc!r}"
    return out


def outcome(r: dict, max_tokens: int) -> str:
    billed = r.get("billed") if r["stream"] else r["tokens"]
    if r["finishes"] > 1 or (billed or 0) > max_tokens:
        return "duplicated"
    if r["status"] == 200 and r["done"] and r["finishes"] == 1 and r["error"] is None:
        return "completed"
    if r["stream"] and r["done"] and r["error"] and r["tokens"] > 0 and r["finishes"] == 0:
        return "errored after first token"
    return "lost"


def run_kill(model: str, args, results: dict) -> None:
    from ray import serve

    from deployments.app import build_app

    base = f"{URL}/goodput"
    if "goodput" not in serve.status().applications:
        serve.run(build_app(app_config(model, "goodput")), name="goodput", route_prefix="/goodput", blocking=False)
        wait_ready([base])
    progress: dict = {}
    n = 16
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(one_request, base, model, i, i % 2 == 0, args.kill_max_tokens, progress)
                   for i in range(n)]
        victim, deadline = None, time.monotonic() + 120
        while victim is None and time.monotonic() < deadline:
            status = httpx.get(f"{base}/v1/smartspec/status", timeout=60).json()
            loaded = [r for r in status["replicas"].values() if r.get("in_flight", 0) >= 6 and r["age_s"] < 2]
            if loaded and progress.get("streamed", 0) >= 4:
                victim = max(loaded, key=lambda r: r["in_flight"])
            time.sleep(0.2)
        if victim is not None:
            os.kill(victim["pid"], signal.SIGKILL)
            print(f"kill: SIGKILL to replica {victim['replica']} (pid {victim['pid']}) with {victim['in_flight']} "
                  f"requests in flight, {victim['running']} running", flush=True)
        else:
            print("kill: no replica reached 6 requests in flight; nothing killed", flush=True)
        answers = [f.result() for f in futures]
    counts = {k: 0 for k in ("completed", "errored after first token", "lost", "duplicated")}
    for a in answers:
        a["outcome"] = outcome(a, args.kill_max_tokens)
        counts[a["outcome"]] += 1
    print(f"{'request':>7s} {'stream':>6s} {'received':>8s} outcome  (received: chunks streamed, or usage tokens)")
    for a in answers:
        print(f"{a['i']:7d} {str(a['stream']):>6s} {a['tokens']:8d} {a['outcome']}"
              + (f" ({a['error'][:60]})" if a["error"] else ""))
    print("  ".join(f"{k}: {v}" for k, v in counts.items()) + "\n", flush=True)
    results["kill"] = {"victim": victim, "answers": answers, "counts": counts}


# ---- autoscale -----------------------------------------------------------------------------------------------------
AUTOSCALE_PHASES = [(0.5, 15), (2.0, 15), (5.0, 40), (0.0, 75)]  # requests a second, for seconds: rise, plateau, stop


def run_autoscale(model: str, args, results: dict) -> None:
    from ray import serve

    from deployments.app import build_app

    for name in ("goodput", "default"):
        if name in serve.status().applications:
            serve.delete(name)
    config = app_config(model, "goodput", autoscaling={
        "min_replicas": 1, "max_replicas": 2, "policy": "goodput", "min_speed_fraction": 0.5,
        "upscale_delay_s": 3, "downscale_delay_s": 15, "look_back_period_s": 5})
    serve.run(build_app(config), name="autoscale", route_prefix="/autoscale", blocking=False)
    base = f"{URL}/autoscale"
    wait_ready([base])
    log = ReplicaLog()
    log.start()
    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        for rate, seconds in AUTOSCALE_PHASES:
            print(f"autoscale: {rate} requests/s for {seconds} s", flush=True)
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                if rate:
                    pool.submit(log.counted, lambda: httpx.post(f"{base}/v1/chat/completions", timeout=600, json={
                        "model": model, "max_tokens": 128, "temperature": 0, "ignore_eos": True,
                        "messages": [{"role": "user", "content": f"Tell me about {random.choice(TOPICS)}."}]}))
                    time.sleep(random.expovariate(rate))
                else:
                    time.sleep(0.5)
    log.stop.set()
    log.join()
    seen = [e["replicas"] for e in log.rows]
    peak = max(seen, default=0)
    up = next((e["t_s"] for e in log.rows if e["replicas"] >= 2), None)
    down = next((e["t_s"] for e in log.rows if up is not None and e["t_s"] > up and e["replicas"] == 1), None)
    print(f"autoscale: replicas {seen[0] if seen else '?'} -> {peak} (at {up} s) -> {seen[-1] if seen else '?'} "
          f"(1 again at {down} s)\n", flush=True)
    results["autoscale"] = {"phases": AUTOSCALE_PHASES, "log": log.rows, "scaled_up_at_s": up,
                            "scaled_down_at_s": down}


class ReplicaLog(threading.Thread):
    """Once a second until stopped: the autoscaled deployment's running and target replicas, and the requests in
    flight (counted by `counted`)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.rows: list[dict] = []
        self.stop = threading.Event()
        self.in_flight = 0

    def counted(self, send) -> None:
        self.in_flight += 1
        try:
            send()
        finally:
            self.in_flight -= 1

    def run(self) -> None:
        from ray import serve

        t0 = time.monotonic()
        while not self.stop.is_set():
            deployment = serve.status().applications["autoscale"].deployments["LLMServer"]
            running = sum(n for state, n in deployment.replica_states.items() if str(state).endswith("RUNNING"))
            self.rows.append({"t_s": round(time.monotonic() - t0, 1), "replicas": running,
                              "target": getattr(deployment, "target_num_replicas", None), "in_flight": self.in_flight})
            time.sleep(1.0)


# ---- plumbing ----------------------------------------------------------------------------------------------------
def wait_ready(bases: list[str], timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    for base in bases:
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=10).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{base} not ready after {timeout} s")
            time.sleep(1)


def plot(results: dict, out_dir: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    if "routing" in results:
        rows = results["routing"]["rows"]
        for router, color in (("default", "tab:gray"), ("goodput", "tab:blue")):
            mine = [r for r in rows if r["router"] == router]
            axes[0].plot([r["cycle"] for r in mine], [r["hit_rate"] for r in mine], "o-", color=color, label=router)
        axes[0].set(xlabel="cycle", ylabel="prefix-cache hit rate", ylim=(0, 1), title="routing: 8 conversations")
        axes[0].legend()
    if "autoscale" in results:
        log = results["autoscale"]["log"]
        axes[1].step([e["t_s"] for e in log], [e["replicas"] for e in log], where="post", label="replicas running")
        twin = axes[1].twinx()
        twin.plot([e["t_s"] for e in log], [e["in_flight"] for e in log], color="tab:orange", alpha=0.6)
        twin.set_ylabel("client requests in flight", color="tab:orange")
        axes[1].set(xlabel="seconds", ylabel="replicas", ylim=(0, 2.5), title="autoscaling (goodput policy)")
    fig.tight_layout()
    fig.savefig(out_dir / "bench_routing.png", dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--parts", nargs="+", default=["routing", "kill", "autoscale"],
                    choices=["routing", "kill", "autoscale"])
    ap.add_argument("--cycles", type=int, default=2)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--kill-max-tokens", type=int, default=160)
    ap.add_argument("--out", default="results/routing")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    os.environ["RAY_AUTH_MODE"] = "disabled"
    t_start = time.monotonic()
    ray_cli("start", "--head", f"--port={GCS.split(':')[1]}", "--num-cpus=2", "--include-dashboard=false",
            "--disable-usage-stats")
    results: dict = {"machine": platform.processor() or platform.machine(), "args": vars(args)}
    try:
        ray_cli("start", f"--address={GCS}", "--num-cpus=2")
        import ray
        from ray import serve

        ray.init(address=GCS, log_to_driver=False)
        print(f"nodes: {len([n for n in ray.nodes() if n['Alive']])}", flush=True)
        serve.start(http_options={"host": "127.0.0.1", "port": PORT})
        for part in args.parts:
            {"routing": run_routing, "kill": run_kill, "autoscale": run_autoscale}[part](args.model, args, results)
        serve.shutdown()
        left = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
        results["left_after_serve_shutdown"] = left
        print(f"after serve.shutdown(): {len(left)} named actors alive {left}", flush=True)
        ray.shutdown()
    finally:
        ray_cli("stop", "--force")
        results["wall_s"] = time.monotonic() - t_start
        (out_dir / "bench_routing.json").write_text(json.dumps(results, indent=1, default=str))
        plot(results, out_dir)
    ratio = (results.get("routing") or {}).get("hit_rate_ratio")
    counts = (results.get("kill") or {}).get("counts") or {}
    print(f"wall time {results['wall_s'] / 60:.1f} min; results in {out_dir}")
    print(f"hit-rate ratio {'n/a' if ratio is None else f'{ratio:.2f}'}; completed {counts.get('completed', 0)}; "
          f"errored after first token {counts.get('errored after first token', 0)}; lost {counts.get('lost', 0)}; "
          f"duplicated {counts.get('duplicated', 0)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
