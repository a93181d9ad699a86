"""Forward time per step shape: SmartSpec's engine vs plain transformers, same model, same run.

Shapes: batch 1 with n = 1, 2, 4, 8, 16 new tokens (a verify step), and batch 1, 4, 8, 16 single-token decodes,
each over a cached context of `--context` tokens (200 by default), timed round-robin. Each shape's cost against a
one-token decode is given two ways: the ratio of the medians, and the geometric mean of the ratios within a round
with its standard error (the box's drift cancels there). Prints a table, writes results/bench_step.parquet and a PNG.

    python scripts/bench_step.py --models qwen2.5-coder-0.5b qwen2.5-coder-1.5b

Its figures: docs/benchmarks.md, "Step cost"."""
from __future__ import annotations

import argparse
import math
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

from smartspec import EngineConfig
from smartspec.engine.llm_engine import LLMEngine
from smartspec.models import resolve
from smartspec.models.loader import gguf_file_of
from smartspec.runtime.model_runner import ForwardItem

CONTEXT = 200  # tokens already in the cache before each timed step (--context)
SHAPES = [(1, n) for n in (1, 2, 4, 8, 16)] + [(b, 1) for b in (4, 8, 16)]


def timed(fn, reps: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def interleaved(fns: dict, reps: int) -> dict:
    """Seconds of each function per round, timed round-robin (one warm-up each), so that the box's drift during the
    run falls on every shape alike rather than on the shapes timed last."""
    for fn in fns.values():
        fn()
    samples = {key: [] for key in fns}
    for _ in range(reps):
        for key, fn in fns.items():
            t = time.perf_counter()
            fn()
            samples[key].append(time.perf_counter() - t)
    return samples


def paired_ratio(samples: list[float], base: list[float]) -> tuple[float, float]:
    """Geometric mean of the per-round ratios samples / base, and its standard error as a fraction: the ratio of
    two shapes timed in the same round, where the box's drift cancels."""
    logs = [math.log(a / b) for a, b in zip(samples, base)]
    se = statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else float("nan")
    return math.exp(statistics.mean(logs)), se


def measure_bandwidth() -> float:
    """Read bandwidth of this machine in GB/s: the better of a 1 GiB fp32 sum and a 1 GiB matrix-vector
    product through torch's BLAS (median of 5 each)."""
    x = torch.ones(2**28)
    a, v = x.view(2**14, 2**14), torch.ones(2**14)
    return max(x.numel() * 4 / timed(lambda: x.sum(), 5), x.numel() * 4 / timed(lambda: a @ v, 5)) / 1e9


def bench_engine(model: str, reps: int, quantization: str | None, context: int) -> tuple[dict, int]:
    # 16 contexts in the cache: a 1.5B model's fp32 KV is ~57 KB a token, 1 GiB holds 16 x 1,000 with room
    engine = LLMEngine(EngineConfig(model=model, kv_cache_gib=max(1.0, context / 1000), max_num_batched_tokens=4096,
                                    quantization=quantization))
    weight_bytes = sum(t.numel() * t.element_size() for t in (*engine.model.parameters(), *engine.model.buffers()))
    gen = torch.Generator().manual_seed(0)
    for i in range(16):  # 16 requests with their context already in the cache
        engine.add_request(torch.randint(100, 5000, (context,), generator=gen).tolist(), request_id=f"b{i}")
    while any(r.num_computed_tokens < context for r in engine.requests.values()):
        batch = engine.scheduler.schedule()
        engine.runner.forward([ForwardItem(s.request, s.request.token_ids[s.request.num_computed_tokens:]
                                           [:s.num_tokens], s.request.num_computed_tokens, 0) for s in batch])
        for s in batch:
            s.request.num_computed_tokens += s.num_tokens
    reqs = [engine.requests[f"b{i}"] for i in range(16)]
    for r in reqs:
        engine.blocks.allocate(r, context + 16)
    steps = {(b, n): [ForwardItem(r, [7] * n, context, n) for r in reqs[:b]] for b, n in SHAPES}
    return interleaved({shape: (lambda items=items: engine.runner.forward(items)) for shape, items in steps.items()},
                       reps), weight_bytes


def bench_transformers(model: str, reps: int, context: int) -> dict:
    from transformers import AutoModelForCausalLM, DynamicCache

    path = resolve(model)
    # the model store keeps a bundled model as its GGUF only: transformers dequantizes it to fp32 at load
    gguf = {} if any(Path(path).glob("*.safetensors")) else {"gguf_file": gguf_file_of(path)}
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **gguf).eval()
    gen = torch.Generator().manual_seed(0)
    out = {}
    with torch.inference_mode():
        for b, n in SHAPES:
            ctx = torch.randint(100, 5000, (b, context), generator=gen)
            cache = DynamicCache(config=hf.config)
            hf(input_ids=ctx, past_key_values=cache, use_cache=True)
            new = torch.full((b, n), 7)

            def step(new=new, cache=cache, n=n):  # bound now, though timed before the loop moves on
                hf(input_ids=new, past_key_values=cache, use_cache=True, logits_to_keep=n)
                cache.crop(-n)  # transformers 5: a negative count of tokens to drop

            out[(b, n)] = timed(step, reps)
    return out


def arguments() -> argparse.ArgumentParser:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--context", type=int, default=CONTEXT, help="tokens cached before each step")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quantization", default="auto", choices=["auto", "gguf", "gguf_exact", "none"],
                    help="the engine's weights (auto: the GGUF blocks of a bundled model)")
    ap.add_argument("--no-transformers", action="store_true",
                    help="time the engine alone (transformers loads the model as fp32: minutes and GBs)")
    ap.add_argument("--out", default="results")
    return ap


def main() -> int:
    args = arguments().parse_args()
    quantization = None if args.quantization == "none" else args.quantization
    torch.set_num_threads(args.threads)
    import pyarrow as pa
    import pyarrow.parquet as pq

    bandwidth = measure_bandwidth()
    print(f"measured read bandwidth: {bandwidth:.1f} GB/s ({args.threads} threads)", file=sys.stderr)
    rows = []
    for model in args.models:
        rows += model_rows(model, args, quantization, bandwidth)
    peak_rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    for r in rows:
        r["peak_rss_gib"] = peak_rss_gib
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), out / "bench_step.parquet")
    print_table(rows, args.models)
    print(f"\nbandwidth {bandwidth:.1f} GB/s; peak RSS {peak_rss_gib:.1f} GiB. vs 1-tok: ratio of medians; paired: "
          f"geometric mean of the per-round ratios to 1 x 1, with its standard error")
    _plot(rows, args.models, out / "bench_step.png", args.context)
    return 0


def model_rows(model: str, args, quantization: str | None, bandwidth: float) -> list[dict]:
    """One model's rows: every step shape on the engine (with its paired ratio to 1 x 1) and on transformers."""
    print(f"[{model}] SmartSpec engine...", file=sys.stderr, flush=True)
    ours, weight_bytes = bench_engine(model, args.reps, quantization, args.context)
    theirs = {}
    if not args.no_transformers:
        print(f"[{model}] plain transformers...", file=sys.stderr, flush=True)
        theirs = bench_transformers(model, args.reps, args.context)
    rows = []
    for (b, n), samples in ours.items():
        ratio, ratio_se = paired_ratio(samples, ours[(1, 1)])
        for impl, sec in (("smartspec", statistics.median(samples)), ("transformers", theirs.get((b, n)))):
            if sec is None:
                continue
            paired = (dict(vs_one_token=ratio, vs_one_token_se=ratio_se) if impl == "smartspec"
                      else dict(vs_one_token=None, vs_one_token_se=None))
            rows.append(dict(model=model, impl=impl, quantization=args.quantization, context=args.context, batch=b,
                             new_tokens=n, ms=sec * 1e3, tokens_per_s=b * n / sec, gb_per_s=weight_bytes / sec / 1e9,
                             bandwidth_gb_per_s=bandwidth, weight_bytes=weight_bytes, threads=args.threads, **paired))
    return rows


def print_table(rows: list[dict], models: list[str]) -> None:
    print(f"\n{'model':20s} {'batch':>5s} {'new':>4s} {'smartspec ms':>13s} {'tf ms':>9s} {'speedup':>8s} "
          f"{'tok/s':>7s} {'GB/s':>6s} {'vs 1-tok':>8s} {'paired':>15s}")
    for model in models:
        mine = {(r["batch"], r["new_tokens"]): r for r in rows if r["model"] == model and r["impl"] == "smartspec"}
        tf = {(r["batch"], r["new_tokens"]): r for r in rows if r["model"] == model and r["impl"] == "transformers"}
        base = mine[(1, 1)]["ms"]
        for key in SHAPES:
            a, t = mine[key], tf.get(key)
            theirs = f"{t['ms']:9.1f} {t['ms'] / a['ms']:7.2f}x" if t else f"{'-':>9s} {'-':>8s}"
            paired = f"{a['vs_one_token']:.3f}x ± {a['vs_one_token_se'] * 100:.1f}%"
            print(f"{model:20s} {key[0]:5d} {key[1]:4d} {a['ms']:13.1f} {theirs} "
                  f"{a['tokens_per_s']:7.1f} {a['gb_per_s']:6.1f} {a['ms'] / base:7.2f}x {paired:>15s}")


def _plot(rows, models, path, context: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    labels = [f"b{b}\nn{n}" for b, n in SHAPES]
    for ax, model in zip(axes[0], models):
        timed_impls = [impl for impl in ("smartspec", "transformers") if any(r["impl"] == impl for r in rows)]
        for j, impl in enumerate(timed_impls):  # --no-transformers: the engine's bars alone
            off, width = (j - (len(timed_impls) - 1) / 2) * 0.4, 0.8 / len(timed_impls)
            ms = [next(r["ms"] for r in rows if r["model"] == model and r["impl"] == impl
                       and (r["batch"], r["new_tokens"]) == s) for s in SHAPES]
            ax.bar([i + off for i in range(len(SHAPES))], ms, width=width, label=impl)
        ax.set_xticks(range(len(SHAPES)), labels)
        ax.set_ylabel(f"ms per forward ({context}-token context)")
        ax.set_title(model)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
