"""Perplexity of a model on a fixed text under each weight format: the check that int8 activations ("gguf") stay
within 1% of the dequantized fp32 model (None) and of the exact quantized path ("gguf_exact").

The text: HumanEval's first problems, prompt and canonical solution, concatenated, scored in windows of --window
tokens (no overlap, each window from scratch) by the engine's own forward (ModelRunner.score: the fused decoder
layers where they run). Prints a table; writes results/perplexity.parquet.

    python scripts/perplexity.py --model qwen2.5-coder-1.5b --tokens 2048

Its figures: docs/benchmarks.md, "Weights, prefix cache, speculation alone" (perplexity)."""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

from smartspec import LLM
from smartspec.bench.workloads import humaneval_problems

FORMATS = {"none": None, "gguf": "gguf", "gguf_exact": "gguf_exact"}


def fixed_text_ids(tokenizer, tokens: int) -> list[int]:
    ids: list[int] = []
    for problem in humaneval_problems():
        ids += tokenizer(problem["prompt"] + problem["canonical_solution"] + "\n\n")["input_ids"]
        if len(ids) >= tokens:
            return ids[:tokens]
    raise ValueError(f"HumanEval holds fewer than {tokens} tokens")


def perplexity(llm: LLM, ids: list[int], window: int) -> tuple[float, int]:
    """exp(mean negative log-likelihood) of every token after the first of each window, and that token count."""
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start:start + window]
        if len(chunk) < 2:
            break
        logits = llm.engine.runner.score(chunk)[:-1]
        nll += torch.nn.functional.cross_entropy(logits, torch.tensor(chunk[1:]), reduction="sum").item()
        count += len(chunk) - 1
        print(f"  {start + len(chunk)}/{len(ids)} tokens", file=sys.stderr, flush=True)
    return math.exp(nll / count), count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    ids = None
    for name in args.formats:
        print(f"{args.model} weights {name}: loading", file=sys.stderr, flush=True)
        llm = LLM(args.model, quantization=FORMATS[name], max_model_len=args.window, kv_cache_gib=0.5)
        ids = ids or fixed_text_ids(llm.tokenizer, args.tokens)
        start = time.perf_counter()
        ppl, count = perplexity(llm, ids, args.window)
        rows.append({"model": args.model, "weights": name, "perplexity": ppl, "tokens": count,
                     "seconds": time.perf_counter() - start})
        del llm
    base = next((r for r in rows if r["weights"] == "none"), rows[0])
    print(f"\n{'weights':12s} {'perplexity':>11s} {'vs ' + base['weights']:>9s} {'tokens':>7s} {'seconds':>8s}")
    for r in rows:
        r["relative"] = r["perplexity"] / base["perplexity"] - 1
        r["relative_to"] = base["weights"]
        print(f"{r['weights']:12s} {r['perplexity']:11.4f} {r['relative']:+9.2%} {r['tokens']:7d} {r['seconds']:8.1f}")
    import pandas as pd

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(out / "perplexity.parquet")
    print(f"wrote {out / 'perplexity.parquet'}")


if __name__ == "__main__":
    main()
