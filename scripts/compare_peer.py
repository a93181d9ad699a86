"""One user's view of SmartSpec against llama.cpp's llama-server on this machine: the same four chats (an edit, a
short answer, new code, a question about a long pasted module; greedy, at most 128 tokens), sent one at a time
(one stream) and four at a time (4 in flight), to each server in turn.

    scripts/llama_peer.sh install          # once: builds llama-server (~10 min on 2 cores)
    python scripts/compare_peer.py --cycles 2 --out results/compare_peer

Servers: ours with config.yaml (or each `--ours LABEL=CONFIG`), and llama-server on the same GGUF target
(`--llama none draft`: plain, and with the same draft; `--no-repack` if its weight repacking crashes on this CPU).
Each of our servers is measured in two modes on the one server: as configured (speculating) and with
`"speculation": {"max_k": 0}` per request (plain decode). Right after each start, one one-stream round of our
speculating mode is kept apart as the "first round after start". Then --rounds steady rounds, each: every mode one
stream, then every mode 4 in flight (the four chats twice, four in flight), the modes' order alternating.

tok/s is a request's completion tokens over its whole latency (prefill included); one stream: the four requests'
tokens over their summed latencies; 4 in flight: all tokens over the wall time. --cycles N serves every server N
times, every other cycle in reverse order, so a drift in the box's speed falls on all alike; each ratio to
llama-server is taken within a cycle and pooled across cycles (mean and standard error). Every request is tagged
once ("[c1-r2-m0-alone-3] ..."), so no prefix cache serves a prompt it has seen. At the end of each of our starts
the speculating mode is asked round 1's plain questions again: its greedy answers must equal plain decode's. The
box's read bandwidth is probed before each server. Writes <out>/runs.jsonl (one row per request),
<out>/comparison.md (the table, and each of our servers' first round over its steady round), <out>/compare_peer.png
and the servers' logs; prints the table with the CPU's name.
Its figures: docs/benchmarks.md, "Serving" (one user against llama.cpp); the README's figure."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx

from smartspec.bench.box_speed import cpu_description, print_probe_spread, record_probe
from smartspec.bench.servers import ROOT, start_server, stop_server
from smartspec.bench.workloads import COMPARE_PROMPTS, compare_messages

PLAIN, FIRST, CHECK = "max_k 0", "first round", "greedy check"


def request_body(model: str, prompt: int, tag: str, max_tokens: int, max_k: int | None) -> dict:
    """Chat `prompt` of the four, its text behind `[tag]`: a tag used once keeps either server's prefix cache from
    serving a prompt it has seen (a new user's request pays its prefill); the same tag asks the very same question."""
    messages = [{**m, "content": f"[{tag}] {m['content']}"} for m in compare_messages()[prompt]]
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    if max_k is not None:  # ours only: the per-request cap on speculation
        body["speculation"] = {"max_k": max_k}
    return body


async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    start = time.perf_counter()
    r = await client.post(f"{url}/v1/chat/completions", json=body)
    latency = time.perf_counter() - start
    r.raise_for_status()
    reply = r.json()
    return {"latency_s": latency, "tokens": reply["usage"]["completion_tokens"],
            "text": reply["choices"][0]["message"]["content"]}


async def one_stream(url: str, model: str, max_tokens: int, max_k: int | None, tag: str) -> list[dict]:
    """The four chats one after the other, tagged `tag`-0 ... `tag`-3."""
    async with httpx.AsyncClient(timeout=600) as client:
        rows = []
        for i in range(len(COMPARE_PROMPTS)):
            body = request_body(model, i, f"{tag}-{i}", max_tokens, max_k)
            rows.append({"prompt": i, "tag": f"{tag}-{i}", **await one_request(client, url, body)})
        return rows


async def in_flight(url: str, model: str, max_tokens: int, max_k: int | None, tag: str, width: int = 4,
                    repeats: int = 2) -> list[dict]:
    """The four chats `repeats` times, `width` in flight (each sent when one finishes); rows carry the wall time."""
    chats = [(i, f"{tag}-{n}") for n, i in enumerate(list(range(len(COMPARE_PROMPTS))) * repeats)]
    rows, gate = [], asyncio.Semaphore(width)
    async with httpx.AsyncClient(timeout=600) as client:
        async def send(i, request_tag):
            async with gate:
                body = request_body(model, i, request_tag, max_tokens, max_k)
                rows.append({"prompt": i, "tag": request_tag, **await one_request(client, url, body)})
        start = time.perf_counter()
        await asyncio.gather(*(send(i, t) for i, t in chats))
        wall = time.perf_counter() - start
    return [{**row, "wall_s": wall} for row in rows]


def tok_s(rows: list[dict], load: str) -> float:
    tokens = sum(r["tokens"] for r in rows)
    return tokens / (rows[0]["wall_s"] if load == "4 in flight" else sum(r["latency_s"] for r in rows))


def servers(args) -> list[dict]:
    """(label, kind, settings, modes) per server; a mode is (row label, max_k sent)."""
    plan = []
    for spec in args.ours:
        label, _, config = spec.partition("=")
        path = Path(config or ROOT / "config.yaml").resolve()
        if not path.exists():
            raise SystemExit(f"--ours {spec}: no file {path}")
        plan.append({"label": label, "kind": "ours", "settings": {"config": path},
                     "modes": [(label, None), (f"{label}, {PLAIN}", 0)]})
    for mode in args.llama:
        label = f"llama.cpp {'plain' if mode == 'none' else mode}"
        plan.append({"label": label, "kind": "llama", "settings": {"mode": mode}, "modes": [(label, None)]})
    return plan


def measure_server(server: dict, url: str, args, cycle: int, log) -> None:
    """The first round after the start, --rounds steady rounds, then (ours) the greedy check: the speculating mode
    asked round 1's plain questions again, tag for tag."""
    def keep(rows, mode, load, rnd):
        for row in rows:
            log({"cycle": cycle, "round": rnd, "server": server["label"], "mode": mode, "load": load,
                 "no_repack": server["kind"] == "llama" and os.environ.get("REPACK") == "0", **row})
        if load != CHECK:
            print(f"    {mode:<34} {load:<12} {tok_s(rows, load):6.2f} tok/s", flush=True)

    modes = server["modes"]
    keep(asyncio.run(one_stream(url, args.model, args.max_tokens, modes[0][1], f"c{cycle}-first")),
         f"{modes[0][0]}, {FIRST}", "one stream", 0)
    for rnd in range(1, args.rounds + 1):
        order = list(enumerate(modes)) if rnd % 2 else list(enumerate(modes))[::-1]
        for m, (mode, max_k) in order:
            keep(asyncio.run(one_stream(url, args.model, args.max_tokens, max_k, f"c{cycle}-r{rnd}-m{m}-alone")),
                 mode, "one stream", rnd)
        for m, (mode, max_k) in order:
            keep(asyncio.run(in_flight(url, args.model, args.max_tokens, max_k, f"c{cycle}-r{rnd}-m{m}-four")),
                 mode, "4 in flight", rnd)
    if len(modes) == 2:  # ours: speculating, then plain (m1)
        keep(asyncio.run(one_stream(url, args.model, args.max_tokens, modes[0][1], f"c{cycle}-r1-m1-alone")),
             modes[0][0], CHECK, args.rounds + 1)


def mean_se(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], float("nan")
    return statistics.mean(values), statistics.stdev(values) / len(values) ** 0.5


def rate(rows: list[dict], mode: str, load: str, cycle: int | None = None, prompt: int | None = None) -> float | None:
    """A mode's tok/s under `load`, the mean over its rounds (of one cycle, of one prompt, where given)."""
    runs = {}
    for r in rows:
        if r["mode"] == mode and r["load"] == load and cycle in (None, r["cycle"]) and prompt in (None, r["prompt"]):
            runs.setdefault((r["cycle"], r["round"]), []).append(r)
    return statistics.mean(tok_s(run, load) for run in runs.values()) if runs else None


def summarize(rows: list[dict], reference: str | None) -> tuple[list[str], dict]:
    """The comparison table (Markdown lines) and its figures: per mode, per-prompt one-stream tok/s, one stream and
    4 in flight tok/s, each pooled over cycles and rounds, and the ratio to `reference` taken within each cycle."""
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    cycles = sorted({r["cycle"] for r in rows})

    figures, lines = {}, []
    head = "| server, mode | " + " | ".join(f"{i + 1} ({p})" for i, p in enumerate(COMPARE_PROMPTS)) + \
        " | one stream tok/s | x llama.cpp | 4 in flight tok/s | x llama.cpp |"
    lines += [head, "|" + "---|" * (len(COMPARE_PROMPTS) + 5)]
    for mode in modes:
        cells, figures[mode] = [], {}
        for p in range(len(COMPARE_PROMPTS)):
            v = rate(rows, mode, "one stream", prompt=p)
            cells.append(f"{v:.1f}" if v else "")
        for load in ("one stream", "4 in flight"):
            per_cycle = {c: v for c in cycles if (v := rate(rows, mode, load, c))}
            if not per_cycle:
                cells += ["", ""]
                continue
            value, se = mean_se(list(per_cycle.values()))
            ratios = [v / base for c, v in per_cycle.items() if reference and (base := rate(rows, reference, load, c))]
            figures[mode][load] = {"tok_s": value, "se": se}
            cells.append(f"{value:.1f}" + (f" ± {se:.1f}" if se == se else ""))
            if ratios and mode != reference:
                ratio, ratio_se = mean_se(ratios)
                figures[mode][load]["ratio"], figures[mode][load]["ratio_se"] = ratio, ratio_se
                cells.append(f"{ratio:.2f}x" + (f" ± {ratio_se:.2f}" if ratio_se == ratio_se else ""))
            else:
                cells.append("")
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    return lines, figures


def first_round_ratios(rows: list[dict], plan: list[dict]) -> list[str]:
    """Per our server: its first round after a start over its steady rounds, one stream, taken within each cycle and
    pooled; and per prompt. Steady rounds ask the first round's questions again, so where the server keeps recent
    answers (the suffix method's answer memory), a steady round can replay them and a first round cannot."""
    notes = []
    for server in (s for s in plan if s["kind"] == "ours"):
        spec = server["modes"][0][0]
        first = f"{spec}, {FIRST}"

        def ratios(prompt=None):
            return [f / s for c in sorted({r["cycle"] for r in rows})
                    if (f := rate(rows, first, "one stream", c, prompt))
                    and (s := rate(rows, spec, "one stream", c, prompt))]

        if not (whole := ratios()):
            continue
        ratio, se = mean_se(whole)
        per_prompt = [f"{name} {statistics.mean(r):.2f}x" if (r := ratios(p)) else f"{name} -"
                      for p, name in enumerate(COMPARE_PROMPTS)]
        notes.append(f"{spec}: first round / steady, one stream: {ratio:.2f}x" + (f" ± {se:.2f}" if se == se else "")
                     + f" (cycles: {', '.join(f'{x:.2f}' for x in whole)}; per prompt: {', '.join(per_prompt)})")
    return notes


def greedy_equal(rows: list[dict], plan: list[dict]) -> list[str]:
    """Per our server: the speculating mode's answers to plain decode's questions, equal to plain decode's?"""
    notes = []
    for server in (s for s in plan if s["kind"] == "ours"):
        (spec, _), (plain, _) = server["modes"]
        plain_text = {(r["cycle"], r["tag"]): r["text"] for r in rows
                      if r["mode"] == plain and r["load"] == "one stream"}
        checked = [r for r in rows if r["mode"] == spec and r["load"] == CHECK]
        same = sum(r["text"] == plain_text.get((r["cycle"], r["tag"])) for r in checked)
        notes.append(f"{spec}: greedy answers equal to {PLAIN}'s in {same} of {len(checked)} requests")
    return notes


def plot(figures: dict, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(figures)
    fig, ax = plt.subplots(figsize=(8, 4))
    for j, load in enumerate(("one stream", "4 in flight")):
        xs = [i + 0.4 * j for i in range(len(modes))]
        ys = [figures[m].get(load, {}).get("tok_s", 0) for m in modes]
        es = [figures[m].get(load, {}).get("se", 0) for m in modes]
        ax.bar(xs, ys, 0.4, yerr=[e if e == e else 0 for e in es], label=load)
    ax.set_xticks([i + 0.2 for i in range(len(modes))], modes, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("tok/s (completion tokens / latency)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def report(out: Path, plan: list[dict]) -> None:
    rows = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    reference = next((s["label"] for s in plan if s["label"] == "llama.cpp plain"), None)
    lines, figures = summarize(rows, reference)
    cpu = cpu_description()
    text = [f"CPU: {cpu}; cycles {len({r['cycle'] for r in rows})}; "
            f"tok/s = completion tokens / latency, pooled mean ± standard error over cycles", "", *lines, "",
            *first_round_ratios(rows, plan), *greedy_equal(rows, plan)]
    if any(r.get("no_repack") for r in rows):
        text.insert(1, "llama-server ran with --no-repack (its weight repacking crashed at start on this CPU)")
    (out / "comparison.md").write_text("\n".join(text) + "\n")
    print("\n".join(text))
    plot(figures, out / "compare_peer.png", f"SmartSpec against llama-server, {cpu.split(';')[0]}")
    print_probe_spread([out])


def start(server: dict, start_args, log: Path) -> tuple:
    """Start the server; llama-server that dies at start while repacking its weights (a crash on some CPUs) is
    started again with --no-repack, for the rest of the run, and the table says so."""
    try:
        return start_server(server["kind"], server["settings"], start_args, log)
    except RuntimeError as exc:
        if server["kind"] != "llama" or os.environ.get("REPACK") == "0" or "exited with -" not in str(exc):
            raise
        print(f"  llama-server crashed at start ({exc}): again with --no-repack", flush=True)
        os.environ["REPACK"] = "0"
        return start_server(server["kind"], server["settings"], start_args, log.with_stem(log.stem + "-no-repack"))


def arguments() -> argparse.ArgumentParser:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ours", nargs="*", default=["smartspec"], metavar="LABEL[=CONFIG]",
                    help="our servers: a label and a Serve config (default config.yaml); none: llama.cpp only")
    ap.add_argument("--llama", nargs="*", default=["none"], choices=["none", "draft", "ngram"],
                    help="llama-server's modes (scripts/llama_peer.sh serve MODE); the ratios are to 'none'")
    ap.add_argument("--no-repack", action="store_true",
                    help="llama-server without its weight repacking (for CPUs where the repacking crashes)")
    ap.add_argument("--cycles", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="steady rounds per server start, after the first round")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--ready-timeout", type=float, default=900)
    ap.add_argument("--out", type=Path, default=Path("results/compare_peer"))
    ap.add_argument("--report", action="store_true", help="run nothing: print the table of <out>/runs.jsonl")
    return ap


def main() -> int:
    ap = arguments()
    args = ap.parse_args()
    if args.cycles < 1 or args.rounds < 1:
        ap.error("--cycles and --rounds must be at least 1")
    plan = servers(args)
    if not plan:
        ap.error("nothing to serve: give --ours or --llama")
    if args.report:
        report(args.out, plan)
        return 0
    if args.llama and not (ROOT / ".llama/bin/llama-server").exists() and "LLAMA_DIR" not in os.environ:
        ap.error("llama-server is not built: scripts/llama_peer.sh install")
    if args.no_repack:
        os.environ["REPACK"] = "0"
    args.out.mkdir(parents=True, exist_ok=True)
    runs = (args.out / "runs.jsonl").open("w")

    def log(row):
        runs.write(json.dumps(row) + "\n")
        runs.flush()

    print(f"CPU: {cpu_description()}; {len(plan)} servers x {args.cycles} cycles", flush=True)
    start_args = SimpleNamespace(ready_timeout=args.ready_timeout)
    for cycle in range(1, args.cycles + 1):
        for server in plan[:: -1 if cycle % 2 == 0 else 1]:
            print(f"[cycle {cycle}/{args.cycles}] {server['label']}", flush=True)
            record_probe(args.out, f"{server['label']} (cycle {cycle})")
            name = server["label"].replace(" ", "-").replace(".", "")
            proc, url = start(server, start_args, args.out / f"server-{name}-{cycle}.log")
            try:
                measure_server(server, url, args, cycle, log)
            finally:
                stop_server(server["kind"], proc)
    record_probe(args.out, "end")
    runs.close()
    report(args.out, plan)
    return 0


if __name__ == "__main__":
    sys.exit(main())
