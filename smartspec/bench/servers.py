"""The servers a serving sweep compares, started and stopped one at a time: ours with `serve run` on a config
written from the checkout's config.yaml, the peers by their scripts (scripts/vllm_peer.sh, scripts/llama_peer.sh).
Used by scripts/sweep_serving.py, scripts/compare_peer.py and scripts/bench_serving_path.py, run from a checkout."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[2]  # the checkout
OURS_PORT, VLLM_PORT, LLAMA_PORT = 8000, 8001, 8011


def ray_cli(name: str) -> str | None:
    """serve / ray: on PATH, or beside this Python (a virtualenv run without activating it)."""
    beside = Path(sys.executable).with_name(name)
    return shutil.which(name) or (str(beside) if beside.exists() else None)


def write_config(policy: str, k: int, path: Path, method: str = "draft_model", trace_dir: Path | None = None,
                 warmup_profile: bool = True) -> Path:
    config = yaml.safe_load((ROOT / "config.yaml").read_text())
    config["applications"][0]["args"]["warmup_profile"] = warmup_profile
    if trace_dir is not None:  # every step of every replica, in <trace_dir>/<replica>/part-*.parquet
        config["applications"][0]["args"]["step_trace_dir"] = str(trace_dir.resolve())
    spec = config["applications"][0]["args"]["speculation"]
    spec["policy"], spec["num_speculative_tokens"] = policy, k
    if method == "mixed":  # the draft model or suffix speculation, per request and step
        spec["method"] = ["draft_model", "suffix"]
    elif method != "draft_model":  # prompt lookup: no draft model, no draft actor
        spec["method"] = method
        for key in ("model", "draft_actor"):
            spec.pop(key, None)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    start = time.time()
    while time.time() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready (see its log)")
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                print(f"  ready after {time.time() - start:.0f} s", flush=True)
                return
        except httpx.HTTPError:
            pass
        time.sleep(5)
    raise TimeoutError(f"{url} not ready after {timeout:.0f} s")


def ray_env() -> dict:
    """The environment Ray and Serve commands run in here: no token auth, workers at the driver's priority."""
    return {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_worker_niceness": "0"}


def start_server(kind: str, settings: dict, args, log: Path) -> tuple[subprocess.Popen, str]:
    env = {**ray_env(), "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "deployments.http.proxy_guard:middlewares"}
    if kind == "ours":
        config = settings.get("config")  # a ready Serve config, as it is; else one written from config.yaml
        if config is None:
            traces = log.with_name(log.stem.replace("server-", "steps-")) if args.server_traces else None
            config = write_config(settings["policy"], args.k, log.with_suffix(".yaml"), settings["method"], traces,
                                  not args.no_warmup_profile)
        cmd, ready, url = [ray_cli("serve"), "run", str(config)], f"http://127.0.0.1:{OURS_PORT}/health", \
            f"http://127.0.0.1:{OURS_PORT}"
    else:
        port = VLLM_PORT if kind == "vllm" else LLAMA_PORT
        cmd = [str(ROOT / f"scripts/{kind}_peer.sh"), "serve", settings["mode"]]
        ready, url = f"http://127.0.0.1:{port}/v1/models", f"http://127.0.0.1:{port}"
    print(f"starting {' '.join(cmd)} (log {log})", flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        wait_ready(ready, proc, args.ready_timeout)
    except Exception:
        stop_server(kind, proc)
        raise
    return proc, url


def stop_server(kind: str, proc: subprocess.Popen) -> None:
    if kind == "ours":
        subprocess.run([ray_cli("serve"), "shutdown", "-y"], cwd=ROOT, capture_output=True, timeout=120)
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    # what outlives the server's own process (vLLM's engine core and worker) would hold its memory into the next run
    for _ in range(30):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            break
        time.sleep(1)
    if kind == "ours":
        subprocess.run([ray_cli("ray"), "stop", "--force"], capture_output=True, timeout=120)
