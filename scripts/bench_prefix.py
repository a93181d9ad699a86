"""Prefix caching on a chat workload that shares a long system prompt: time to first token and latency per request,
with and without caching, same engine settings, same run (the two configurations interleaved, repeated).

The system prompt: HumanEval's first problems as worked examples (about --system-tokens tokens); each request asks
for one of the next problems. Requests are served one after another (the first of each repeat fills the cache).

    python scripts/bench_prefix.py --model qwen2.5-coder-1.5b --requests 6 --repeats 2

Prints a table; writes results/bench_prefix.parquet and results/bench_prefix.png.
Its figures: docs/benchmarks.md, "Weights, prefix cache, speculation alone" (prefix caching)."""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from smartspec import LLM, SamplingParams
from smartspec.bench.workloads import humaneval_problems


def chat_prompts(tokenizer, system_tokens: int, n: int) -> tuple[list[str], int]:
    """n chat prompts sharing one system prompt of about system_tokens tokens; and that prompt's length."""
    problems = humaneval_problems()
    examples, used = [], 0
    for p in problems:
        if len(tokenizer("\n\n".join(examples))["input_ids"]) >= system_tokens:
            break
        examples.append(p["prompt"] + p["canonical_solution"])
        used += 1
    system = "You write Python functions. Worked examples:\n\n" + "\n\n".join(examples)
    asks = [f"Complete this function:\n{p['prompt']}" for p in problems[used:used + n]]
    prompts = [tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": a}],
                                             tokenize=False, add_generation_prompt=True) for a in asks]
    return prompts, len(tokenizer(system)["input_ids"])


def arguments() -> argparse.ArgumentParser:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="results")
    return parser


def main() -> int:
    args = arguments().parse_args()
    torch.set_num_threads(args.threads)
    engines = {caching: LLM(args.model, kv_cache_gib=1.0, max_model_len=4096, enable_prefix_caching=caching)
               for caching in (False, True)}
    prompts, system_len = chat_prompts(engines[True].tokenizer, args.system_tokens, args.requests)
    import pandas as pd

    df = pd.DataFrame(run(engines, prompts, args))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    df.to_parquet(out / "bench_prefix.parquet")
    print(f"\nsystem prompt {system_len} tokens; prompts {df.prompt_tokens.min()}-{df.prompt_tokens.max()} tokens; "
          f"{args.max_tokens} output tokens; {args.repeats} repeats")
    print(f"{'caching':8s} {'requests':>8s} {'TTFT first':>11s} {'TTFT later':>11s} {'latency later':>14s}")
    for caching in (False, True):
        d = df[df.caching == caching]
        first, later = d[d.request == 0], d[d.request > 0]
        print(f"{'on' if caching else 'off':8s} {len(d):8d} {first.ttft_s.mean():10.2f}s {later.ttft_s.mean():10.2f}s "
              f"{later.latency_s.mean():13.2f}s")
    ratio = [b / a for a, b in zip(df[(~df.caching) & (df.request > 0)].ttft_s,
                                   df[df.caching & (df.request > 0)].ttft_s)]
    print(f"TTFT with caching / without, requests after the first: {statistics.mean(ratio):.3f} "
          f"(min {min(ratio):.3f}, max {max(ratio):.3f})")
    plot(df, f"{args.model}: chat sharing a {system_len}-token system prompt", out / "bench_prefix.png")
    print(f"wrote {out / 'bench_prefix.parquet'} and {out / 'bench_prefix.png'}")
    return 0


def run(engines: dict, prompts: list[str], args) -> list[dict]:
    """The prompts one after another on each engine (caching off and on), the order reversed every other repeat;
    per request its TTFT and latency."""
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    for repeat in range(args.repeats):
        order = (False, True) if repeat % 2 == 0 else (True, False)
        for caching in order:
            llm = engines[caching]
            llm.engine.blocks.reset_prefix_cache()  # each repeat's first request pays the system prompt again
            for i, prompt in enumerate(prompts):
                start = time.perf_counter()
                out = llm.generate(prompt, params)[0]
                rows.append({"caching": caching, "repeat": repeat, "request": i, "ttft_s": out.ttft_s,
                             "latency_s": out.latency_s, "prompt_tokens": len(out.prompt_token_ids),
                             "wall_s": time.perf_counter() - start})
                print(f"  repeat {repeat} caching {caching!s:5s} request {i}: ttft {out.ttft_s:.2f} s, "
                      f"latency {out.latency_s:.2f} s", file=sys.stderr, flush=True)
    return rows


def plot(df, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for caching, d in df.groupby("caching"):
        ax.plot(d.groupby("request").ttft_s.mean(), marker="o", label=f"prefix caching {'on' if caching else 'off'}")
    ax.set_xlabel("request (one after another)")
    ax.set_ylabel("time to first token (s)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
