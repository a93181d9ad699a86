"""Decode speed with the packed weights on 2 MiB pages against 4 KiB pages, in one process: the weights are copied
back and forth between a mapping that asks for transparent huge pages and one that refuses them, and each copy
decodes the same prompt (the two alternate, so the box's drift falls on both).

    python scripts/bench_pages.py --model qwen2.5-coder-1.5b --repeats 8

Prints a table and the paired ratio (geometric mean over the pairs, ± its standard error); writes results/bench_pages.parquet and .png.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from smartspec import LLM, SamplingParams
from smartspec.bench.report import paired_ratio
from smartspec.runtime.page_arena import PageArena
from smartspec.runtime.quant_linear import Q8Linear


def move_weights(blobs: list[torch.Tensor], huge_pages: bool) -> PageArena:
    """Copy every blob into a new arena and point the tensor at its copy (the fused layers hold the same tensors)."""
    arena = PageArena(sum(b.nbytes + 64 for b in blobs), huge_pages=huge_pages)
    for b in blobs:
        copy = arena.zeros(tuple(b.shape), b.dtype)
        copy.copy_(b)
        b.set_(copy)
    return arena


def decode_ms(llm: LLM, prompt: str, tokens: int) -> float:
    """ms a decoded token: a run of `tokens` + 1 tokens less a run of 1 (the prefill), over `tokens`."""
    start = time.perf_counter()
    llm.generate(prompt + " a", SamplingParams(max_tokens=1, ignore_eos=True))
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate(prompt + " b", SamplingParams(max_tokens=tokens + 1, ignore_eos=True))
    return (time.perf_counter() - start - prefill) / tokens * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, max_model_len=2048, kv_cache_gib=1.0, quantization="gguf")
    blobs = [m.blob for m in llm.engine.runner.model.modules() if isinstance(m, Q8Linear)]
    if not blobs:
        print(f"{args.model}: no int8 GGUF weights (needs a GGUF model and AVX-512 VNNI kernels)", file=sys.stderr)
        return 1
    prompt = " ".join(f"item{i} = value{i * 7 % 13};" for i in range(40))  # about 280 tokens of context
    llm.generate(prompt, SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    rows = []
    for repeat in range(args.repeats):
        for huge in (False, True) if repeat % 2 == 0 else (True, False):
            arena = move_weights(blobs, huge)
            ms = decode_ms(llm, prompt, args.tokens)
            rows.append({"repeat": repeat, "pages": "2 MiB" if arena.huge_pages else "4 KiB", "ms_per_token": ms})
            print(f"  repeat {repeat}: {rows[-1]['pages']} pages {ms:.2f} ms a token", file=sys.stderr, flush=True)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    df = pd.DataFrame(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    df.to_parquet(out / "bench_pages.parquet")
    wide = df.pivot(index="repeat", columns="pages", values="ms_per_token")
    print(f"\n{args.model}, {args.tokens} decoded tokens a run, {args.repeats} pairs")
    print(f"{'pages':8s} {'mean ms':>8s} {'min':>7s} {'max':>7s}")
    for pages in wide.columns:
        print(f"{pages:8s} {wide[pages].mean():8.2f} {wide[pages].min():7.2f} {wide[pages].max():7.2f}")
    if {"2 MiB", "4 KiB"} <= set(wide.columns):
        ratio, se = paired_ratio(list(wide["2 MiB"] / wide["4 KiB"]))
        print(f"2 MiB / 4 KiB: {ratio:.3f} (± {100 * se:.1f}%, geometric mean over the pairs)")
    fig, ax = plt.subplots(figsize=(6, 4))
    for pages in wide.columns:
        ax.plot(wide.index, wide[pages], marker="o", label=f"{pages} pages")
    ax.set_xlabel("pair")
    ax.set_ylabel("ms a decoded token")
    ax.set_title(f"{args.model}: weights on 2 MiB vs 4 KiB pages")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "bench_pages.png", dpi=120)
    print(f"wrote {out / 'bench_pages.parquet'} and {out / 'bench_pages.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
