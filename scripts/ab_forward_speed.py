"""Does a policy slow the forward it chooses for? Two policies, one request at a time, interleaved (A B, B A, ...).

bench_policies.py compares policies by latency, and on this box the same work can take 10-20% longer from one run
to the next (the memory bandwidth the VM gets moves within minutes). When two policies choose the same drafts
(smartspec and fixed:5 with prompt lookup at light load) and one of them still ran slower steps, this says whether
the policy is the cause: every repeat serves one prompt with each policy in turn, alternating which goes first,
and compares the target forward's time (StepRecord.verify_s, which holds none of the policy's own work) and the
rest of the step (choice, proposal, acceptance, bookkeeping) at the same batch shape.

Prints per repeat and pooled medians; writes <out>/ab_forward_speed.parquet (one row per decode step) and
<out>/ab_forward_speed.png.

    python scripts/ab_forward_speed.py --policies fixed:5 smartspec --repeats 8 --out results/ab
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

from smartspec import EngineConfig, SamplingParams
from smartspec.engine.llm_engine import LLMEngine
from smartspec.policy import make_policy
from smartspec.spec.ngram import NgramProposer
from smartspec.workloads import humaneval_prompts


class CollectorClock:
    """Seconds Python's cyclic garbage collector ran, and its full collections: a policy that allocates more
    objects per step makes collections come more often, and they land wherever allocation happens, mostly in the
    forward."""

    def __init__(self) -> None:
        self.seconds, self.full, self._start = 0.0, 0, 0.0
        gc.callbacks.append(self._on)

    def _on(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start
            self.full += info["generation"] == 2


def serve_one(engine: LLMEngine, prompt: str, max_tokens: int, collector: CollectorClock) -> list[dict]:
    """One request alone to the end; its decode steps (prefill steps are the same under every policy)."""
    engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    steps = []
    while engine.has_unfinished():
        gc_s, full = collector.seconds, collector.full
        engine.step()
        r = engine.last_step
        if r.num_prefill_tokens == 0:
            steps.append(dict(forward_s=r.verify_s, rest_s=r.total_s - r.verify_s, gc_s=collector.seconds - gc_s,
                              full_collections=collector.full - full, batched_tokens=r.num_batched_tokens,
                              context_tokens=r.num_context_tokens))
    return steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--policies", nargs=2, default=["fixed:5", "smartspec"], metavar=("A", "B"))
    ap.add_argument("--k-max", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="results/ab")
    args = ap.parse_args()
    if args.repeats < 1 or args.max_tokens < 2:
        ap.error("--repeats must be at least 1 and --max-tokens at least 2 (the first token comes from the prefill; "
                 "decode steps are what is compared)")
    if args.policies[0] == args.policies[1]:
        ap.error(f"--policies: two different policies to compare, got {args.policies[0]!r} twice")
    try:  # before the model loads: a typo fails in a second, not after a minute
        policies = {name: make_policy(name, args.k_max, key="ngram:ab") for name in args.policies}
    except ValueError as exc:
        ap.error(f"--policies: {exc}")
    torch.set_num_threads(args.threads)
    engine = LLMEngine(EngineConfig(model=args.target, kv_cache_gib=1.0, max_num_seqs=4, max_model_len=2048,
                                    max_num_batched_tokens=256,
                                    speculative_config={"method": "ngram", "num_speculative_tokens": args.k_max,
                                                        "policy": "off"}))
    ngram = NgramProposer(4, 1)  # bench_policies.py's prompt lookup
    for policy in policies.values():
        if policy.wants_profile:
            engine.set_speculation(ngram, policy, args.k_max)
            engine.profile_steps()
    prompts = sorted(humaneval_prompts("chat", 164, engine.tokenizer), key=lambda p: len(engine.tokenizer(p).input_ids))
    rows, collector = [], CollectorClock()
    for repeat in range(args.repeats):
        order = args.policies if repeat % 2 == 0 else args.policies[::-1]
        for name in order:
            engine.set_speculation(ngram, policies[name], args.k_max)
            # the 8 shortest prompts in turn, the requests of bench_policies.py --requests 8
            steps = serve_one(engine, prompts[repeat % 8], args.max_tokens, collector)
            rows += [dict(policy=name, repeat=repeat, **s) for s in steps]
            print(f"[{repeat + 1}/{args.repeats}] {name:10s} {len(steps):3d} decode steps, forward median "
                  f"{statistics.median(s['forward_s'] for s in steps):.4f} s, rest "
                  f"{statistics.median(s['rest_s'] for s in steps) * 1e3:.2f} ms", file=sys.stderr, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), out / "ab_forward_speed.parquet")
    per_run = {name: [statistics.median(r["forward_s"] for r in rows if r["policy"] == name and r["repeat"] == k)
                      for k in range(args.repeats)] for name in args.policies}
    a, b = args.policies
    print(f"\n{'policy':10s} {'forward s (median of runs)':>27s} {'rest ms':>8s} {'GC ms/step':>10s} "
          f"{'full GCs':>8s}  runs: forward median s")
    for name in args.policies:
        mine = [r for r in rows if r["policy"] == name]
        rest = statistics.median(r["rest_s"] for r in mine) * 1e3
        gc_ms = sum(r["gc_s"] for r in mine) / len(mine) * 1e3
        print(f"{name:10s} {statistics.median(per_run[name]):27.4f} {rest:8.2f} {gc_ms:10.2f} "
              f"{sum(r['full_collections'] for r in mine):8d}  " + " ".join(f"{x:.3f}" for x in per_run[name]))
    ratios = [y / x for x, y in zip(per_run[a], per_run[b])]
    print(f"\n{b} / {a} forward time, per repeat: " + " ".join(f"{r:.2f}" for r in ratios)
          + f"; median {statistics.median(ratios):.3f}, {sum(r > 1 for r in ratios)} of {len(ratios)} above 1")
    _plot(per_run, out / "ab_forward_speed.png")
    return 0


def _plot(per_run: dict[str, list[float]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, values in per_run.items():
        ax.plot(range(1, len(values) + 1), values, marker="o", label=name)
    ax.set_xlabel("repeat (order alternates)")
    ax.set_ylabel("median target forward per decode step (s)")
    ax.set_title("Forward time under two policies, same request, interleaved")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
