"""Two SmartSpec replicas on a two-node Ray cluster started on this machine, with quantized weights.

    python scripts/two_replicas.py                     # the default pair, quantization gguf, 8 requests
    python scripts/two_replicas.py --requests 16 --max-tokens 48

It starts a head node and a second node (`ray start --head`, then `ray start --address`, each with 1 logical
CPU so that each replica's placement group, replica and draft actor, fits on one node only), deploys the
application with `num_replicas: 2` and `quantization: gguf`, sends requests concurrently, and prints where each
replica ran, how many steps and tokens it served, its RSS, and the goodput controller's merged state. Everything it
started is stopped at the end. Needs the default models fetched and nothing else on ports 6390 and 8000.
Its figures: docs/serving.md, "Several replicas"."""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import subprocess
import sys
import time

import httpx

PORT, GCS = 8000, "127.0.0.1:6390"
PROMPTS = ["Write a Python function that checks whether a number is prime.",
           "Write a Python function that reverses a linked list.",
           "Write a Python function that merges two sorted lists.",
           "Write a Python function that counts the words in a string."]


def ray_cli(*args: str) -> None:
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    subprocess.run([ray, *args], check=True, capture_output=True, text=True)


def rss_gb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 2**20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray_cli("start", "--head", f"--port={GCS.split(':')[1]}", "--num-cpus=1", "--include-dashboard=false",
            "--disable-usage-stats")
    try:
        ray_cli("start", f"--address={GCS}", "--num-cpus=1")
        return run(args)
    finally:
        ray_cli("stop", "--force")


def run(args) -> int:
    import ray
    from ray import serve

    from deployments.app import build_app

    ray.init(address=GCS, log_to_driver=False)
    print(f"nodes: {len([n for n in ray.nodes() if n['Alive']])}", flush=True)
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    config = {"num_replicas": 2, "quantization": "gguf", "num_threads": 1, "replica_num_cpus": 0.5,
              "max_model_len": 2048, "kv_cache_gib": 0.5,
              "speculation": {"draft_num_cpus": 0.25, "draft_num_threads": 1}}
    t0 = time.monotonic()
    serve.run(build_app(config), name="smartspec", route_prefix="/")
    print(f"deployed in {time.monotonic() - t0:.0f} s", flush=True)
    url = f"http://127.0.0.1:{PORT}"

    def ask(i: int) -> dict:
        body = {"model": "qwen2.5-coder-1.5b", "max_tokens": args.max_tokens, "temperature": 0,
                "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
        r.raise_for_status()
        return r.json()

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(args.requests) as pool:
        answers = list(pool.map(ask, range(args.requests)))
    print(f"{len(answers)} requests answered in {time.monotonic() - t0:.1f} s", flush=True)
    time.sleep(3)  # replicas report to the controller about once a second
    status = httpx.get(f"{url}/v1/smartspec/status", timeout=60).json()
    print(f"\n{'replica':12s} {'node':14s} {'steps':>6s} {'tokens':>7s} {'drafted':>8s} {'RSS GiB':>7s}")
    nodes = set()
    for rid, r in status["replicas"].items():
        nodes.add(r["node_id"])
        steps = r.get("steps") or {}
        print(f"{rid:12s} {r['node_id'][:12]:14s} {steps.get('steps', 0):6d} {steps.get('generated_tokens', 0):7d} "
              f"{(r.get('spec_decode') or {}).get('num_draft_tokens', 0):8d} {rss_gb(r['pid']):7.2f}")
    drafts = subprocess.run(["pgrep", "-f", "DraftWorker"], capture_output=True, text=True).stdout.split()
    print(f"draft actors: {len(drafts)}, RSS {', '.join(f'{rss_gb(int(p)):.2f}' for p in drafts)} GiB")
    merged = status.get("merged_policy") or {}
    print(f"controller: merged state of {merged.get('replicas', 0)} replicas, acceptance prior "
          f"{merged.get('prior', {}).get('first')}")
    served = [rid for rid, r in status["replicas"].items() if (r.get("steps") or {}).get("steps", 0) > 0]
    ok = len(status["replicas"]) == 2 and len(served) == 2 and len(nodes) == 2 and merged.get("replicas") == 2
    print("\nOK: two replicas on two nodes both served requests, and the controller merged their state" if ok
          else "\nNOT OK: see the table above")
    serve.shutdown()
    ray.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
