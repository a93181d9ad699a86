"""Speculative decoding on HumanEval: tokens/s, acceptance and mean accepted length, per proposer and k.

Configurations: off, and fixed k = 1, 3, 5 for the draft model (Qwen2.5-Coder-0.5B) and prompt lookup, on the
target Qwen2.5-Coder-1.5B; and token trees of n nodes (--trees NODES:DEPTH:BRANCHING, n = 3 and 5 by default),
which verify n + 1 tokens per request like a chain of k = n: mean accepted length per target forward and tokens/s
at equal verification budget. Each runs single stream (the prompts one at a time) and in batches of 4 and 8, on raw
HumanEval prompts and on the same problems in the chat template. As the outside reference, in the same run,
transformers' own generate: plain greedy, assisted generation (assistant_model=, 4 tokens) and prompt lookup
(prompt_lookup_num_tokens=4), single stream (it does not batch speculation).
Prints a table; writes results/bench_spec.parquet and results/bench_spec.png.

    python scripts/bench_spec.py                     # everything (about 30 min on 2 cores)
    python scripts/bench_spec.py --variants chat --batches 1 --max-tokens 32   # a quick look
    python scripts/bench_spec.py --no-transformers --ks 3 5 --trees 3:2:2 5:3:2 5:2:4   # chains vs trees

Its figures: docs/benchmarks.md, "Weights, prefix cache, speculation alone" (speculation on HumanEval)."""
from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

from smartspec import EngineConfig, SamplingParams
from smartspec.bench.workloads import humaneval_prompts
from smartspec.engine.llm_engine import LLMEngine
from smartspec.types.snapshot import StepTotals
from smartspec.models import resolve
from smartspec.policy import FixedPolicy, OffPolicy
from smartspec.spec_decode.config import SpeculativeConfig, TreeConfig
from smartspec.spec_decode.factory import make_proposer
from smartspec.spec_decode.ngram import NgramProposer


def run_batchwise(engine: LLMEngine, prompts: list[str], batch: int, params: SamplingParams) -> dict:
    engine.stats = StepTotals()
    tokens, t0 = 0, time.perf_counter()
    for i in range(0, len(prompts), batch):
        for p in prompts[i:i + batch]:
            engine.add_request(p, params)
        while engine.has_unfinished():
            tokens += sum(len(o.new_token_ids) for o in engine.step())
    wall = time.perf_counter() - t0
    m, t = engine.speculation.metrics, engine.stats
    return dict(tokens=tokens, wall_s=wall, tokens_per_s=tokens / wall, acceptance=m.acceptance_rate,
                mean_accepted_length=m.mean_acceptance_length, drafts=m.num_drafts, steps=t.steps,
                draft_s=t.draft_s, verify_s=t.verify_s, other_s=t.busy_s - t.draft_s - t.verify_s)


def bench_smartspec(args, prompts_by_variant) -> list[dict]:
    engine = LLMEngine(EngineConfig(
        model=args.target, kv_cache_gib=1.0, max_num_seqs=max(args.batches), max_model_len=2048,
        speculative_config={"method": "draft_model", "model": args.draft, "num_speculative_tokens": 5}))
    draft = engine.speculation.proposer
    proposers = {"draft_model": draft, "ngram": NgramProposer(n_max=4, n_min=1)}
    configs = [("off", draft, 0)] + [(f"{name} k={k}", proposers[name], k) for name in args.methods
                                     for k in args.ks]
    for nodes, depth, branching in args.trees:  # a tree of n nodes verifies n + 1 tokens, as a chain of k = n does
        for name in args.methods:
            spec = SpeculativeConfig(method=name, model=args.draft if name == "draft_model" else None,
                                     policy="off", tree={"max_nodes": nodes, "max_depth": depth,
                                                         "branching": branching})
            tree = make_proposer(spec, engine.draft_runtime(draft.blocks.num_blocks))
            configs.append((f"{name} tree n={nodes} d={depth} b={branching}", tree, nodes))
    rows = []
    params = SamplingParams(max_tokens=args.max_tokens)
    for variant, prompts in prompts_by_variant.items():
        for batch in args.batches:
            use = prompts[: args.single_prompts] if batch == 1 else prompts[:batch]
            for label, proposer, k in configs:
                engine.set_speculation(proposer, FixedPolicy(k) if k else OffPolicy(), max(k, 1))
                print(f"[smartspec] {variant} batch={batch} {label} ...", file=sys.stderr, flush=True)
                r = run_batchwise(engine, use, batch, params)
                rows.append(dict(impl="smartspec", variant=variant, batch=batch, config=label,
                                 method="off" if k == 0 else label.split()[0], k=k, tree="tree" in label,
                                 prompts=len(use), **r))
    del engine, draft
    gc.collect()
    return rows


def bench_transformers(args, prompts_by_variant) -> list[dict]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve(args.target))
    target = AutoModelForCausalLM.from_pretrained(resolve(args.target), dtype=torch.float32).eval()
    assistant = AutoModelForCausalLM.from_pretrained(resolve(args.draft), dtype=torch.float32).eval()
    assistant.generation_config.num_assistant_tokens = 4
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    assistant.generation_config.assistant_confidence_threshold = 0.0
    configs = [("transformers greedy", {}), ("transformers assisted k=4", {"assistant_model": assistant}),
               ("transformers prompt-lookup k=4", {"prompt_lookup_num_tokens": 4})]
    rows = []
    for variant, prompts in prompts_by_variant.items():
        for label, extra in configs:
            print(f"[transformers] {variant} {label} ...", file=sys.stderr, flush=True)
            tokens, t0 = 0, time.perf_counter()
            for p in prompts[: args.single_prompts]:
                ids = tok(p, return_tensors="pt")
                out = target.generate(**ids, max_new_tokens=args.max_tokens, do_sample=False, **extra)
                tokens += out.shape[1] - ids.input_ids.shape[1]
            wall = time.perf_counter() - t0
            rows.append(dict(impl="transformers", variant=variant, batch=1, config=label, method=label, k=4,
                             prompts=args.single_prompts, tokens=tokens, wall_s=wall, tokens_per_s=tokens / wall,
                             acceptance=float("nan"), mean_accepted_length=float("nan"), drafts=0, steps=0,
                             draft_s=float("nan"), verify_s=float("nan"), other_s=float("nan")))
    return rows


def _tree_spec(text: str) -> tuple[int, int, int]:
    try:
        nodes, depth, branching = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"tree {text!r}: expected NODES:DEPTH:BRANCHING, e.g. 5:3:2") from None
    return nodes, depth, branching


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--variants", nargs="+", default=["raw", "chat"], choices=["raw", "chat"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 4, 8])
    ap.add_argument("--ks", nargs="+", type=int, default=[1, 3, 5])
    ap.add_argument("--methods", nargs="+", default=["draft_model", "ngram"], choices=["draft_model", "ngram"])
    ap.add_argument("--trees", nargs="*", type=_tree_spec, default=[(3, 2, 2), (5, 3, 2)],
                    help="token trees as NODES:DEPTH:BRANCHING (compare with chains of k = NODES)")
    ap.add_argument("--single-prompts", type=int, default=4, help="prompts run one at a time for batch 1")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--out", default="results")
    args = ap.parse_args()
    if max(args.ks) > 5:
        ap.error("--ks at most 5 (the engine is built with K = 5)")
    try:
        [TreeConfig(*t) for t in args.trees]
    except ValueError as exc:
        ap.error(str(exc))
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve(args.target))
    n = max(max(args.batches), args.single_prompts)
    prompts = {v: humaneval_prompts(v, n, tok) for v in args.variants}
    rows = bench_smartspec(args, prompts)
    if not args.no_transformers:
        rows += bench_transformers(args, prompts)
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), out / "bench_spec.parquet")
    print(f"\n{'variant':7s} {'batch':>5s} {'config':32s} {'tok/s':>7s} {'vs off':>7s} {'accept':>7s} "
          f"{'mean len':>8s} {'draft s':>8s} {'verify s':>8s}")
    for r in rows:
        off = next((x["tokens_per_s"] for x in rows if x["impl"] == "smartspec" and x["config"] == "off"
                    and x["variant"] == r["variant"] and x["batch"] == r["batch"]), float("nan"))
        print(f"{r['variant']:7s} {r['batch']:5d} {r['config']:32s} {r['tokens_per_s']:7.2f} "
              f"{r['tokens_per_s'] / off:6.2f}x {r['acceptance']:7.2f} {r['mean_accepted_length']:8.2f} "
              f"{r['draft_s']:8.1f} {r['verify_s']:8.1f}")
    _plot(rows, out / "bench_spec.png")
    return 0


def _plot(rows, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["variant"], r["batch"]) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(4.5 * len(groups), 4.5), squeeze=False)
    for ax, (variant, batch) in zip(axes[0], groups):
        sel = [r for r in rows if r["variant"] == variant and r["batch"] == batch]
        ax.barh([r["config"] for r in sel], [r["tokens_per_s"] for r in sel],
                color=["tab:orange" if r["impl"] == "transformers" else "tab:blue" for r in sel])
        ax.set_title(f"HumanEval {variant}, batch {batch}")
        ax.set_xlabel("output tokens/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
