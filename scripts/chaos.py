"""Faults under a steady mixed load: what clients see when parts of a running SmartSpec die, drain or roll.

    python scripts/chaos.py                                  # the default pair, every fault, ~15 min on 2 cores
    python scripts/chaos.py --faults kill-replica kill-draft --load-s 20
    python scripts/chaos.py --model qwen2.5-coder-0.5b --draft qwen2.5-coder-0.5b   # lighter

It starts a two-node Ray cluster on this machine (`ray start --head`, then a second node with `ray start
--address`, each 1 logical CPU), deploys the application with two LLMServer replicas, one per node, each with its
draft model in an actor of its own (`draft_actor: true`), and keeps 16 clients, each with 3 requests in flight,
sending a mix: streamed chats, n = 2 seeded completions, unseeded sampled chats (whole and streamed), JSON-schema
chats, tool calls and streams the client hangs up on. Then, in turn, it injects each fault, keeps the load on until
the application is healthy again (every replica running, a request answered), and waits for every request of that
window to end:

  kill-replica     kill -9 of an LLMServer replica process
  kill-draft       kill -9 of a draft actor
  kill-controller  kill -9 of the goodput controller
  kill-ingress     kill -9 of the OpenAI ingress replica
  scale-down       a deploy with Serve's override LLMServer num_replicas 1 (one replica drains), then 2
  rolling-update   a deploy of a changed config (Serve replaces the replicas one by one)
  node-stop        the second node's raylet stopped (as `ray stop` there), then the node started again

Per fault it prints the requests of its window and what became of them: completed; named errors, allowed only
for a stream that had already sent tokens when its replica died (its error event: no retry can take back what the
client has read); lost, any request that should have been answered and was not (a dropped connection, a stream cut
without [DONE], a 5xx or an error event of any other request, named or not); refused (a 4xx: named, counted apart);
duplicated (a choice answered twice); hung (no end within --hang-s); and the seconds back to healthy. Hang-ups are
the client's own and are counted apart. Then the named errors and the losses, itemized by cause. Afterwards every
replica's KV blocks must be free. The last line: `faults F; requests R; completed C; named errors E; lost L;
duplicated D; hung H`. Raw rows go to --out.
Needs the models fetched, and nothing else on ports 6390, 6391, 8000 and 8001.
Its figures: docs/benchmarks.md, "Faults under load (chaos)"; docs/serving.md, "Operating under faults"."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

PORT, GCS, WORKER_PORT, WORKER_PROXY_PORT = 8000, "127.0.0.1:6390", 6391, 8001
PROXY_GUARD = "deployments.http.proxy_guard:middlewares"
URL = f"http://127.0.0.1:{PORT}"
FAULTS = ("kill-replica", "kill-draft", "kill-controller", "kill-ingress", "scale-down", "rolling-update",
          "node-stop")
KINDS = ("stream", "n2", "json", "sampled", "tools", "sampled_stream", "hangup")
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ANSWER_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "lines": {"type": "integer"}},
                 "required": ["name", "lines"], "additionalProperties": False}


@dataclass
class Outcome:
    fault: str
    kind: str
    outcome: str  # completed | named | lost | refused | duplicated | hung | hung_up
    status: int | None
    seconds: float
    detail: str = ""


# ---- the load ------------------------------------------------------------------------------------------------
def request_of(kind: str, model: str, max_tokens: int, i: int) -> tuple[str, dict]:
    user = {"role": "user", "content": f"Write a Python function number {i} that adds two numbers."}
    if kind == "n2":
        return "/v1/completions", {"model": model, "prompt": f"def add_{i}(a, b):", "max_tokens": max_tokens,
                                   "n": 2, "temperature": 0.8, "seed": i}
    if kind == "json":
        return "/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": "Name a Python function and its length."}],
            "max_tokens": max_tokens * 2, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}}
    if kind in ("sampled", "sampled_stream"):  # unseeded: a retry answers with another draw, as good as the first
        return "/v1/chat/completions", {"model": model, "messages": [user], "max_tokens": max_tokens,
                                        "temperature": 0.9, "top_p": 0.95, "stream": kind == "sampled_stream"}
    if kind == "tools":
        return "/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "tools": [WEATHER_TOOL], "tool_choice": "auto", "max_tokens": max_tokens * 2, "temperature": 0}
    return "/v1/chat/completions", {"model": model, "messages": [user], "max_tokens": max_tokens,
                                    "temperature": 0, "stream": True}


def judge_whole(status: int, body: dict, n: int) -> tuple[str, str]:
    """A whole answer: a 4xx is a named refusal; a 5xx, named or not, is a request that should have been answered
    (a replica's death before the answer is the failover's to absorb)."""
    if status >= 400:
        named = isinstance(body, dict) and isinstance(body.get("error"), dict) and body["error"].get("message")
        detail = str(body["error"]["message"])[:120] if named else f"{status} without a message"
        return ("refused" if status < 500 and named else "lost"), detail
    choices = body.get("choices") or []
    indexes = [c.get("index") for c in choices]
    if len(indexes) != len(set(indexes)) or len(choices) > n:
        return "duplicated", f"choices {indexes}"
    if len(choices) != n or any(c.get("finish_reason") not in ("stop", "length", "tool_calls") for c in choices):
        return "lost", f"choices {indexes}, finish {[c.get('finish_reason') for c in choices]}"
    return "completed", ""


async def send(client: httpx.AsyncClient, fault: str, kind: str, model: str, max_tokens: int, i: int,
               hang_s: float) -> Outcome:
    path, body = request_of(kind, model, max_tokens, i)
    began = time.monotonic()

    def outcome(what: str, status: int | None, detail: str = "") -> Outcome:
        return Outcome(fault, kind, what, status, round(time.monotonic() - began, 2), detail)

    try:
        async with asyncio.timeout(hang_s):
            if not body.get("stream"):
                r = await client.post(URL + path, json=body)
                try:
                    answer = r.json()
                except ValueError:
                    return outcome("lost", r.status_code, f"not JSON: {r.text[:80]!r}")
                what, detail = judge_whole(r.status_code, answer, body.get("n", 1))
                return outcome(what, r.status_code, detail)
            async with client.stream("POST", URL + path, json=body) as r:
                if r.status_code >= 400:
                    await r.aread()
                    try:
                        what, detail = judge_whole(r.status_code, r.json(), 1)
                        return outcome(what, r.status_code, detail)
                    except ValueError:
                        return outcome("lost", r.status_code, "error without a JSON body")
                return outcome(*await judge_stream(r, kind))
    except TimeoutError:
        return outcome("hung", None, f"no end in {hang_s:.0f} s")
    except httpx.HTTPError as exc:
        return outcome("lost", None, f"{type(exc).__name__}: {exc}"[:120])


async def judge_stream(r: httpx.Response, kind: str) -> tuple[str, int | None, str]:
    """A streamed answer read to its end (a hang-up: to its first chunk): what became of it, the status, detail."""
    finished, done, error, tokens = {}, False, None, False
    async for line in r.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            done = True
            break
        chunk = json.loads(data)
        if "error" in chunk:
            error = chunk["error"]
            continue
        for c in chunk.get("choices", []):
            tokens = tokens or bool((c.get("delta") or {}).get("content"))
            if c.get("finish_reason"):
                finished[c["index"]] = finished.get(c["index"], 0) + 1
        if kind == "hangup":
            return "hung_up", r.status_code, ""
    if error is not None:  # allowed once tokens were read: what the client has seen cannot be redone
        return "named" if tokens else "lost", error.get("code"), str(error.get("message"))[:120]
    if any(v > 1 for v in finished.values()):
        return "duplicated", r.status_code, f"finish events {finished}"
    if done and finished:
        return "completed", r.status_code, ""
    return "lost", r.status_code, f"stream ended: done={done}, finished={finished}"


async def load(fault: str, model: str, max_tokens: int, clients: int, in_flight: int, stop: asyncio.Event,
               hang_s: float, counter: list[int]) -> list[Outcome]:
    """`clients` clients (a connection pool each), each keeping `in_flight` requests going until stop."""
    outcomes: list[Outcome] = []

    async def one_in_flight(client: httpx.AsyncClient) -> None:
        while not stop.is_set():
            counter[0] += 1
            kind = KINDS[counter[0] % len(KINDS)]
            outcomes.append(await send(client, fault, kind, model, max_tokens, counter[0], hang_s))
            if outcomes[-1].outcome not in ("completed", "hung_up"):
                await asyncio.sleep(0.5)  # a client backs off after an error, as an SDK's retry would

    async def client_loop() -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(hang_s + 5)) as client:
            await asyncio.gather(*(one_in_flight(client) for _ in range(in_flight)))

    await asyncio.gather(*(client_loop() for _ in range(clients)))
    return outcomes


# ---- the cluster and its faults ------------------------------------------------------------------------------
def ray_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    return subprocess.run([ray, *args], check=True, capture_output=True, text=True, env={**os.environ, **(env or {})})


def start_worker_node() -> None:
    # the second node's proxy on a port of its own (two proxies on one machine would otherwise share 8000, and the
    # kernel would hand it some of the clients' connections): the clients talk to the head's, as to a cluster's
    # entry point; what a client of a dying node's own proxy sees is in docs/serving.md
    ray_cli("start", f"--address={GCS}", "--num-cpus=1", f"--node-manager-port={WORKER_PORT}",
            "--disable-usage-stats", env={"RAY_SERVE_WORKER_PROXY_HTTP_PORT": str(WORKER_PROXY_PORT)})


def pids(pattern: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out if int(p) != os.getpid()]


def kill9(pattern: str) -> str:
    found = pids(pattern)
    if not found:
        raise RuntimeError(f"no process matches {pattern!r}")
    os.kill(found[0], signal.SIGKILL)
    return f"kill -9 {found[0]} ({pattern})"


def app_config(args, **changes) -> dict:
    # each node has 1 logical CPU, and a replica's placement group (replica 0.5, draft actor 0.25) fits one node
    # (the replica count is deploy's; max_waiting is what the rolling update changes)
    return {"model": args.model, "replica_num_cpus": 0.5, "max_waiting": 63 if args.rolled else 64,
            "num_threads": 1, "max_model_len": 2048, "kv_cache_gib": 0.5, "replica_wait_s": 60,
            "speculation": {"method": "draft_model", "model": args.draft, "num_speculative_tokens": 4,
                            "draft_actor": True, "draft_num_cpus": 0.25, "draft_num_threads": 1},
            **changes}


def deploy(config: dict, replicas: int = 2) -> None:
    """As `serve run config.yaml` deploys: the application's args, and the LLMServer replica count as Serve's own
    deployment override. Serve applies an override to the running replicas (a scale-down drains one); a change
    under args is a new code version, and Serve replaces every replica (a rolling update)."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    _get_global_client().deploy_apps(ServeDeploySchema.model_validate({
        "http_options": {"host": "127.0.0.1", "port": PORT},
        "applications": [{"name": "smartspec", "route_prefix": "/", "import_path": "deployments.app:build_app",
                          "args": config, "deployments": [{"name": "LLMServer", "num_replicas": replicas}]}]}))


PARTS = ("ServeReplica:smartspec:LLMServer", "ray::DraftWorker", "ServeReplica:smartspec:GoodputController",
         "ServeReplica:smartspec:OpenAIIngress")


def parts() -> dict[str, int]:
    """How many processes of each part run."""
    return {part: len(pids(part)) for part in PARTS}


def restored(before: dict[str, int]) -> bool:
    """Healthy (two replicas running, a request answered) with every part back to its count before the fault."""
    return parts() == before and healthy(2)


def healthy(replicas: int) -> bool:
    """Every LLMServer replica running and a request answered."""
    from ray import serve

    try:
        app = serve.status().applications.get("smartspec")
        if app is None or app.status != "RUNNING":
            return False
        server = app.deployments["LLMServer"]
        if server.status != "HEALTHY" or server.replica_states.get("RUNNING", 0) != replicas:
            return False
        r = httpx.post(f"{URL}/v1/completions", json={"model": MODEL[0], "prompt": "1 + 1 =", "max_tokens": 2},
                       timeout=30)
        return r.status_code == 200
    except Exception:
        return False


MODEL = [""]  # the served model name, set at start


def inject(fault: str, args) -> str:
    if fault == "kill-replica":
        return kill9("ServeReplica:smartspec:LLMServer")
    if fault == "kill-draft":
        return kill9("ray::DraftWorker")
    if fault == "kill-controller":
        return kill9("ServeReplica:smartspec:GoodputController")
    if fault == "kill-ingress":
        return kill9("ServeReplica:smartspec:OpenAIIngress")
    if fault == "scale-down":
        deploy(app_config(args), replicas=1)
        return "deploy with LLMServer num_replicas 1"
    if fault == "rolling-update":
        args.rolled = True
        deploy(app_config(args))
        return "deploy of a changed config (max_waiting 64 -> 63)"
    if fault == "node-stop":
        raylets = pids(f"raylet.*--node_manager_port={WORKER_PORT}") or pids(f"raylet.*{WORKER_PORT}")
        if not raylets:
            raise RuntimeError("the second node's raylet is not running")
        os.kill(raylets[0], signal.SIGTERM)
        return f"SIGTERM to the second node's raylet {raylets[0]}"
    raise ValueError(fault)


def recover(fault: str, args) -> None:
    """What an operator does after the fault, before the next: scale back up, start the node again."""
    if fault == "scale-down":
        wait_until(lambda: healthy(1), args.heal_s)
        deploy(app_config(args))
    if fault == "node-stop":
        time.sleep(10)
        start_worker_node()


def wait_until(check, timeout: float) -> float | None:
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        if check():
            return time.monotonic() - began
        time.sleep(1)
    return None


async def run_fault(fault: str, args) -> tuple[list[Outcome], float | None, str]:
    stop, counter = asyncio.Event(), [0]
    task = asyncio.create_task(load(fault, MODEL[0], args.max_tokens, args.clients, args.in_flight, stop,
                                    args.hang_s, counter))
    await asyncio.sleep(args.load_s)
    before = await asyncio.to_thread(parts)
    injected_at = time.monotonic()
    what = await asyncio.to_thread(inject, fault, args)
    print(f"  {fault}: {what}", flush=True)
    # back to healthy: once the fault shows (a part missing, a replica not running), every part back again
    await asyncio.to_thread(wait_until, lambda: not restored(before), 60)
    await asyncio.to_thread(recover, fault, args)
    back = await asyncio.to_thread(wait_until, lambda: restored(before), args.heal_s)
    back = None if back is None else time.monotonic() - injected_at
    await asyncio.sleep(args.load_s)
    stop.set()
    return await task, back, what


def kv_free(timeout: float = 120) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            replicas = httpx.get(f"{URL}/v1/smartspec/status", timeout=30).json()["replicas"].values()
            if replicas and all(r["free_blocks"] == r["total_blocks"] and r["in_flight"] == 0 for r in replicas):
                return True
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(2)
    return False


def summary(rows: list[Outcome]) -> dict:
    count = {k: sum(r.outcome == k for r in rows) for k in ("completed", "named", "lost", "refused", "duplicated",
                                                           "hung", "hung_up")}
    return {"requests": len(rows), **count}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--faults", nargs="+", default=list(FAULTS), choices=FAULTS)
    ap.add_argument("--clients", type=int, default=16, help="concurrent clients of the steady load")
    ap.add_argument("--in-flight", type=int, default=3, help="requests each client keeps in flight")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--load-s", type=float, default=15, help="seconds of load before each fault and after healing")
    ap.add_argument("--heal-s", type=float, default=300, help="the most seconds to wait for health after a fault")
    ap.add_argument("--hang-s", type=float, default=120, help="a request without an end this long is hung")
    ap.add_argument("--out", default="results/chaos.jsonl")
    args = ap.parse_args()
    if args.clients < 1 or args.in_flight < 1 or args.max_tokens < 1:
        ap.error("--clients, --in-flight and --max-tokens must be at least 1")
    args.rolled = False
    MODEL[0] = args.model
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ.setdefault("RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH", PROXY_GUARD)  # as the README's command sets it
    ray_cli("start", "--head", f"--port={GCS.split(':')[1]}", "--num-cpus=1", "--include-dashboard=false",
            "--disable-usage-stats")
    try:
        start_worker_node()
        return run(args)
    except Exception:
        traceback.print_exc()  # before Ray is stopped below, which takes the driver's stderr with it
        return 1
    finally:
        try:
            from ray import serve
            serve.shutdown()
        except Exception:
            pass
        ray_cli("stop", "--force")


def run(args) -> int:
    import ray
    from ray import serve

    ray.init(address=GCS, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    began = time.monotonic()
    deploy(app_config(args))
    if wait_until(lambda: healthy(2), args.heal_s * 2) is None:
        print("the application did not become healthy", file=sys.stderr)
        return 1
    print(f"deployed: 2 replicas on 2 nodes in {time.monotonic() - began:.0f} s; faults: {' '.join(args.faults)}",
          flush=True)
    rows, table = [], []
    for fault in args.faults:
        outcomes, back, _ = asyncio.run(run_fault(fault, args))
        rows += outcomes
        s = summary(outcomes)
        table.append((fault, s, back))
        print(f"  {fault}: {s}, back to healthy in {'-' if back is None else f'{back:.0f} s'}", flush=True)
    free = kv_free()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(asdict(r)) + "\n" for r in rows))
    print(f"\n{'fault':16s} {'requests':>8s} {'completed':>9s} {'named':>6s} {'lost':>5s} {'refused':>7s} "
          f"{'dup':>4s} {'hung':>5s} {'hang-ups':>8s} {'back (s)':>8s}")
    for fault, s, back in table:
        print(f"{fault:16s} {s['requests']:8d} {s['completed']:9d} {s['named']:6d} {s['lost']:5d} {s['refused']:7d} "
              f"{s['duplicated']:4d} {s['hung']:5d} {s['hung_up']:8d} {'-' if back is None else f'{back:.0f}':>8s}")
    for what in ("named", "refused", "lost", "duplicated", "hung"):  # itemized by cause: fault, kind, status, why
        causes: dict[tuple, int] = {}
        for r in rows:
            if r.outcome == what:
                cause = (r.fault, r.kind, r.status, r.detail[:70])
                causes[cause] = causes.get(cause, 0) + 1
        for (fault, kind, status, detail), n in sorted(causes.items(), key=lambda x: -x[1])[:12]:
            print(f"  {what} {n}x: {fault} {kind} {status} {detail}")
    total = summary(rows)
    print(f"KV blocks all free afterwards: {'yes' if free else 'no'}; raw rows: {out}")
    print(f"faults {len(table)}; requests {total['requests']}; completed {total['completed']}; named errors "
          f"{total['named']}; lost {total['lost']}; duplicated {total['duplicated']}; hung {total['hung']}")
    return 0 if not (total["lost"] or total["duplicated"] or total["hung"]) and free else 1


if __name__ == "__main__":
    sys.exit(main())
