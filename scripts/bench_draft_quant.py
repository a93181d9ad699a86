"""A cheaper draft: the draft model's GGUF blocks as they are ("gguf") against re-quantized to 4 bits at load
("gguf_q4", smartspec/runtime/requantize.py). Three measures, one process, both pairs loaded side by side:

  draft cost      the draft alone, batch-1 greedy decode of 64 tokens (tok/s, --repeats times each, interleaved)
  acceptance      the pair at fixed k = K on the prompts, batched: draft tokens accepted / proposed
  one stream      the pair under the goodput policy, one request at a time, each prompt sent to both engines in
                  turn (the order alternating), round 0 a warm-up; tok/s per request and the paired ratio's
                  geometric mean with its standard error. Every pair of outputs must be equal token for token.

    python scripts/bench_draft_quant.py                   # ~6 min on 2 cores
    python scripts/bench_draft_quant.py --rounds 5 --max-tokens 96

Prints a table, writes the raw rows to --out (JSON) and a plot beside it (PNG).
Its figures: docs/benchmarks.md, "Weights, prefix cache, speculation alone" (the re-quantized draft)."""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

from smartspec import LLM, SamplingParams
from smartspec.engine.profile_cache import cpu_name
from smartspec.policy.baselines import FixedPolicy

QUESTIONS = [
    "Rewrite this function to use a list comprehension:\n\ndef squares(xs):\n    out = []\n    for x in xs:\n"
    "        out.append(x * x)\n    return out",
    "What is the difference between a list and a tuple in Python?",
    "Write a Python function that checks whether a number is prime.",
    "Write a function that merges two sorted lists.",
    "Explain what a Python decorator is, with an example.",
]
KINDS = ("gguf", "gguf_q4")


def draft_speed(args) -> list[dict]:
    drafts = {kind: LLM(args.draft, quantization=kind, max_model_len=1024, enable_prefix_caching=False)
              for kind in KINDS}
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    rows = []
    for repeat in range(args.repeats + 1):  # repeat 0 warms both
        for kind in (KINDS if repeat % 2 else KINDS[::-1]):
            began = time.perf_counter()
            drafts[kind].generate(["def fibonacci(n):"], params)
            if repeat:
                rows.append({"measure": "draft", "kind": kind, "repeat": repeat,
                             "tok_s": 64 / (time.perf_counter() - began)})
    return rows


def pairs(args) -> dict[str, LLM]:
    out = {}
    for kind in KINDS:
        began = time.perf_counter()
        out[kind] = LLM(args.model, max_model_len=2048, enable_prefix_caching=False, speculative_config={
            "method": "draft_model", "model": args.draft, "num_speculative_tokens": args.k, "policy": "smartspec",
            "draft_quantization": None if kind == "gguf" else kind})
        print(f"{kind}: pair ready in {time.perf_counter() - began:.1f} s", file=sys.stderr, flush=True)
    return out


class CountingFixed(FixedPolicy):
    """k = K for every request, counting the draft tokens proposed and accepted."""

    def __init__(self, k: int) -> None:
        super().__init__(k)
        self.proposed = self.accepted = 0

    def observe(self, record) -> None:
        self.proposed += sum(record.proposed)
        self.accepted += sum(record.accepted)


def acceptance(engines: dict[str, LLM], texts: list[str], args) -> list[dict]:
    rows = []
    for kind, llm in engines.items():
        kept, counted = llm.engine.speculation.policy, CountingFixed(args.k)
        llm.engine.set_speculation(policy=counted)  # this measure's plans only
        try:
            llm.generate(texts, SamplingParams(max_tokens=args.max_tokens, temperature=0.0))
        finally:
            llm.engine.set_speculation(policy=kept)
        rows.append({"measure": "acceptance", "kind": kind, "proposed": counted.proposed,
                     "accepted": counted.accepted, "rate": counted.accepted / max(counted.proposed, 1)})
    return rows


def one_stream(engines: dict[str, LLM], texts: list[str], args) -> list[dict]:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    rows = []
    for rnd in range(args.rounds + 1):
        for i, text in enumerate(texts):
            outputs = {}
            for kind in (KINDS if (rnd + i) % 2 == 0 else KINDS[::-1]):
                began = time.perf_counter()
                out = engines[kind].generate([text], params)[0]
                seconds = time.perf_counter() - began
                outputs[kind] = out.token_ids
                rows.append({"measure": "stream", "kind": kind, "round": rnd, "prompt": i,
                             "tokens": len(out.token_ids), "s": seconds, "tok_s": len(out.token_ids) / seconds})
            if outputs["gguf"] != outputs["gguf_q4"]:
                raise AssertionError(f"prompt {i}, round {rnd}: the two drafts' outputs differ (lossless broken)")
        print(f"round {rnd} done", file=sys.stderr, flush=True)
    return rows


def paired_ratio(rows: list[dict]) -> tuple[float, float, int]:
    """q4 over gguf: the geometric mean of per-request tok/s ratios (rounds >= 1) and its standard error (as a
    factor)."""
    by = {(r["round"], r["prompt"], r["kind"]): r["tok_s"] for r in rows if r["measure"] == "stream" and r["round"]}
    logs = [math.log(by[(rnd, p, "gguf_q4")] / by[(rnd, p, "gguf")]) for rnd, p, kind in by if kind == "gguf"]
    return math.exp(statistics.mean(logs)), math.exp(statistics.stdev(logs) / math.sqrt(len(logs))), len(logs)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stream = [r for r in rows if r["measure"] == "stream" and r["round"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    for kind, marker in zip(KINDS, "os"):
        points = [(r["prompt"] + (0.1 if kind == "gguf_q4" else -0.1), r["tok_s"]) for r in stream
                  if r["kind"] == kind]
        ax.scatter(*zip(*points), marker=marker, label=f"draft {kind}")
    ax.set_xlabel("prompt")
    ax.set_ylabel("tok/s, one stream (goodput policy)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds of one stream (after a warm-up round)")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats of the draft's own decode")
    ap.add_argument("--out", default="results/bench_draft_quant.json")
    args = ap.parse_args()
    if args.rounds < 2 or args.repeats < 1 or args.max_tokens < 1 or not 1 <= args.k <= 32:
        ap.error("need --rounds >= 2, --repeats >= 1, --max-tokens >= 1 and --k in [1, 32]")
    rows = draft_speed(args)
    engines = pairs(args)
    tokenizer = engines["gguf"].tokenizer
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True) for q in QUESTIONS]
    rows += acceptance(engines, texts, args)
    rows += one_stream(engines, texts, args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpu": cpu_name(), "date": time.strftime("%Y-%m-%d"), "args": vars(args),
                               "rows": rows}, indent=1))
    plot(rows, out.with_suffix(".png"))
    ratio, se, n = paired_ratio(rows)
    print(f"\n{cpu_name()}; {args.model} with the draft {args.draft}, K = {args.k}\n")
    print(f"{'draft':8s} {'draft tok/s':>11s} {'acceptance':>10s} {'one stream tok/s':>16s}")
    for kind in KINDS:
        speed = statistics.median(r["tok_s"] for r in rows if r["measure"] == "draft" and r["kind"] == kind)
        (acc,) = [r["rate"] for r in rows if r["measure"] == "acceptance" and r["kind"] == kind]
        stream = [r for r in rows if r["measure"] == "stream" and r["round"] and r["kind"] == kind]
        tok_s = sum(r["tokens"] for r in stream) / sum(r["s"] for r in stream)
        print(f"{kind:8s} {speed:11.1f} {acc:10.3f} {tok_s:16.2f}")
    print(f"\none stream, gguf_q4 over gguf: {ratio:.3f} (standard error x{se:.3f}, {n} paired requests); "
          f"outputs equal; raw rows {out}, plot {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
