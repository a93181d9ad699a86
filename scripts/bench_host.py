"""The engine's own host time per step, by stage (docs/benchmarks.md, "The engine's host time"): an engine whose
target forward returns its logits at once (smartspec/bench/instant_runner.py; a tiny random model's config and
byte-level tokenizer) decodes 1, 64 and 256 requests at once, with prompt lookup drafting chains or token trees
of K (fixed k = K by default, the same shapes every run; the goodput policy's own time is bench_select's); in the
mix, an eighth of the requests each use penalties, logprobs, a grammar (regex) or temperature sampling (`--plain`:
every request greedy; `--sampled`: every request sampled as chat traffic is, temperature 0.8, top-p 0.9, top-k 50,
unseeded). Each row times `--steps` decoding steps after every prompt is in, stage by stage, with the start's heap
frozen out of the collector's full collections as a replica freezes it (runtime/heap.py); then counts the device
operations (kernel launches on a GPU) of a few more steps, untimed.

    python scripts/bench_host.py                    # ~2 min on 2 cores
    python scripts/bench_host.py --rows 64 --steps 20 --drafts chain
    python scripts/bench_host.py --rows 64 --decoded 3000   # requests 3,000 tokens in: history-bound costs

Prints a table (ms per step by stage) and writes results/bench_host/{stages.parquet, host.png}; the last line:
`host ms per step: 1 row A; 64 rows B; 256 rows C`, each the slower of chains and trees."""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from smartspec.bench.instant_runner import InstantRunner
from smartspec.bench.tiny_models import build_tiny_model
from smartspec.config import EngineConfig
from smartspec.engine import llm_engine
from smartspec.engine.llm_engine import LLMEngine
from smartspec.runtime.heap import frozen_heap
from smartspec.types.sampling_params import SamplingParams, StructuredOutput
from torch.utils._python_dispatch import TorchDispatchMode

CYCLE_TEXT = "abcdefghijklmnop"  # the stand-in continues this cycle (one byte-level token a letter)
PROMPT_TOKENS = 48
WARM_STEPS = 3  # decoding steps run before the timed ones
# engine/llm_engine.py's functions the step calls, by stage
MODULE_STAGES = {"plan_step": "plan", "propose": "propose", "cut_to_grammars": "propose",
                 "take_prompt_logprobs": "accept", "accept_drafts": "accept"}
STAGES = ["schedule", "plan", "propose", "prepare inputs", "forward (stand-in)", "accept", "commit", "record",
          "observe"]


MIXES = ("mixed", "plain", "sampled")
COUNTED_STEPS = 3  # steps whose device operations are counted, after the timed ones


def params_of(i: int, max_tokens: int, mix: str = "mixed") -> SamplingParams:
    """"mixed": of every 8 requests, one with penalties, one with logprobs, one under a grammar, one sampled at
    temperature 0.8 (seeded); the rest greedy. "plain": every one greedy. "sampled": every one sampled (temperature
    0.8, top-p 0.9, top-k 50, unseeded)."""
    if mix == "sampled":
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.8, top_p=0.9, top_k=50)
    kind = i % 8 if mix == "mixed" else 0
    extra = {1: {"repetition_penalty": 1.1, "presence_penalty": 0.2},
             2: {"logprobs": 3},
             3: {"structured": StructuredOutput(regex=f"[{CYCLE_TEXT[0]}-{CYCLE_TEXT[-1]}]+")},
             4: {"temperature": 0.8, "seed": i}}.get(kind, {})
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **extra)


class StageClock:
    """Seconds per stage of the engine's step, taken by wrapping the calls the step is made of: the engine's own
    methods, and the module functions its step calls, put back by close()."""

    def __init__(self, engine: LLMEngine, runner: InstantRunner) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.runner = runner
        self.unwrapped = {name: getattr(llm_engine, name) for name in MODULE_STAGES}
        for name, stage in MODULE_STAGES.items():
            setattr(llm_engine, name, self._timed(self.unwrapped[name], stage))
        engine.scheduler.schedule = self._timed(engine.scheduler.schedule, "schedule")
        engine._commit = self._timed(engine._commit, "commit")
        engine._record = self._timed(engine._record, "record")
        policy = engine.speculation.policy
        policy.observe = self._timed(policy.observe, "observe")

    def _timed(self, call, stage: str):
        def timed(*args, **kwargs):
            began = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds[stage] += time.perf_counter() - began
        return timed

    def close(self) -> None:
        for name, call in self.unwrapped.items():
            setattr(llm_engine, name, call)

    def reset(self) -> None:
        self.seconds.clear()
        self.runner.prepare_s = self.runner.execute_s = 0.0

    def per_step(self, steps: int, total_s: float) -> dict[str, float]:
        """ms per step by stage; the runner's two parts apart; what no stage holds as "other"."""
        ms = {stage: 1e3 * self.seconds.get(stage, 0.0) / steps for stage in STAGES}
        ms["prepare inputs"] = 1e3 * self.runner.prepare_s / steps
        ms["forward (stand-in)"] = 1e3 * self.runner.execute_s / steps
        ms["other"] = max(0.0, 1e3 * total_s / steps - sum(ms.values()))
        return ms


def engine_for(model: str, rows: int, drafts: str, k: int, policy: str = "fixed", context: int = 512) \
        -> tuple[LLMEngine, InstantRunner]:
    """An engine over the stand-in for `rows` requests of up to `context` tokens at once: prompt lookup drafting
    chains or trees of k."""
    spec = {"method": "ngram", "num_speculative_tokens": k, "policy": policy}
    if drafts == "tree":
        spec["tree"] = {"max_nodes": k, "max_depth": k, "branching": 2}
    made: list[InstantRunner] = []

    def runner_factory(loaded, blocks):
        cycle = loaded.tokenizer.convert_tokens_to_ids(list(CYCLE_TEXT))
        made.append(InstantRunner(loaded.config.vocab_size, blocks, cycle))
        return made[0]

    config = EngineConfig(model=model, num_kv_blocks=rows * (context // 16 + 2) + 64, block_size=16,
                          max_num_seqs=rows, max_num_batched_tokens=max(512, rows * (k + 1) + PROMPT_TOKENS),
                          max_model_len=context,
                          quantization=None, use_kernels=False, cuda_graphs=False, speculative_config=spec)
    return LLMEngine(config, runner_factory=runner_factory), made[0]


class DeviceOps(TorchDispatchMode):
    """Counts the tensor operations run while active: on a GPU each is a kernel launch (or a host-side view), the
    host's share of a step that a device's pace exposes."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def measure(model: str, rows: int, drafts: str, k: int, steps: int, policy: str = "fixed", mix: str = "mixed",
            decoded: int = 0) -> dict:
    """ms per step by stage over `steps` decoding steps of `rows` requests, after every prompt is in and the
    furthest request has decoded `decoded` tokens (the row's `decoded`: their mean)."""
    context = context_for(k, steps, decoded)
    engine, runner = engine_for(model, rows, drafts, k, policy, context)
    prompt = (CYCLE_TEXT * (PROMPT_TOKENS // len(CYCLE_TEXT) + 1))[:PROMPT_TOKENS]
    ids = engine.tokenizer(prompt)["input_ids"]
    max_tokens = context - len(ids) - 1  # enough for every measured step at the deepest draft
    for i in range(rows):
        engine.add_request(list(ids), params_of(i, max_tokens, mix), request_id=f"r{i}")
    clock = StageClock(engine, runner)
    try:
        with frozen_heap():  # as a replica serves: start's objects out of the collector's full collections
            while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
                engine.step()
            for _ in range(WARM_STEPS):  # first uses (a sampler's generator, a grammar's first masks) are not steady
                engine.step()
            while max(r.num_output_tokens for r in engine.requests.values()) < decoded:  # sampled ones trail
                engine.step()
            now_decoded = sum(r.num_output_tokens for r in engine.requests.values()) // rows
            clock.reset()
            ks_before, began = sum(engine.stats.chosen_k.values()), time.perf_counter()
            drafted_before = sum(k * n for k, n in engine.stats.chosen_k.items())
            for _ in range(steps):
                engine.step()
            total_s = time.perf_counter() - began
            stages, chosen = clock.per_step(steps, total_s), dict(engine.stats.chosen_k)
            with DeviceOps() as ops:
                for _ in range(COUNTED_STEPS):
                    engine.step()
    finally:
        clock.close()
    if len(engine.requests) != rows:
        raise RuntimeError(f"{rows - len(engine.requests)} requests finished inside the measured steps")
    mean_k = (sum(k * n for k, n in chosen.items()) - drafted_before) / max(1, sum(chosen.values()) - ks_before)
    engine.close()
    return {"rows": rows, "drafts": drafts, "mix": mix, "k": k, "steps": steps, "decoded": now_decoded,
            "mean_k": mean_k,
            "host_ms": 1e3 * total_s / steps, **stages, "device_ops": ops.count / COUNTED_STEPS}


def context_for(k: int, steps: int, decoded: int) -> int:
    """The context that holds the prompt, `decoded` tokens and every step measured after them at the deepest
    draft, in whole blocks."""
    need = PROMPT_TOKENS + decoded + (k + 1) * (steps + WARM_STEPS + COUNTED_STEPS + 3)
    return max(512, -(-need // 16) * 16)


def print_table(results: list[dict]) -> None:
    columns = ["host_ms", *STAGES, "other"]
    print(f"{'rows':>5s} {'drafts':>6s} {'mean k':>6s} {'decoded':>7s} " + " ".join(f"{c[:12]:>12s}" for c in columns)
          + f" {'device ops':>10s}")
    for r in results:
        print(f"{r['rows']:5d} {r['drafts']:>6s} {r['mean_k']:6.2f} {r['decoded']:7d} "
              + " ".join(f"{r[c]:12.3f}" for c in columns)
              + f" {r['device_ops']:10.0f}")


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    labels = [f"{r['rows']} {r['drafts']}" for r in results]
    bottom = [0.0] * len(results)
    for stage in [*STAGES, "other"]:
        values = [r[stage] for r in results]
        ax.bar(labels, values, bottom=bottom, label=stage)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("host ms per step")
    ax.set_title("The engine's host time per step, by stage (target forward returns at once)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256], help="decoding requests at once")
    ap.add_argument("--drafts", nargs="+", choices=["chain", "tree"], default=["chain", "tree"])
    ap.add_argument("--k", type=int, default=4, help="K: draft tokens of a chain, nodes of a tree")
    ap.add_argument("--steps", type=int, default=40, help="decoding steps timed per row")
    ap.add_argument("--policy", default="fixed", help="the speculation policy (fixed: k = K; smartspec, off, ...)")
    kinds = ap.add_mutually_exclusive_group()
    kinds.add_argument("--plain", action="store_true",
                       help="every request greedy, no controls (the base the mix adds to)")
    kinds.add_argument("--sampled", action="store_true", help="every request sampled (temperature 0.8, top-p 0.9, "
                       "top-k 50, unseeded): chat traffic")
    ap.add_argument("--decoded", type=int, default=0,
                    help="tokens the furthest request has decoded before the timed steps (what grows with a request's "
                         "history shows here)")
    ap.add_argument("--out", default="results/bench_host")
    args = ap.parse_args(argv)
    if min(args.rows) < 1 or args.steps < 1 or args.k < 1 or not 0 <= args.decoded <= 32768:
        ap.error("--rows, --steps and --k must be >= 1, --decoded from 0 to 32768")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_tiny_model(Path(tmp) / "tiny", positions=context_for(args.k, args.steps, args.decoded)))
        for rows in args.rows:
            for drafts in args.drafts:
                mix = "plain" if args.plain else "sampled" if args.sampled else "mixed"
                results.append(measure(model, rows, drafts, args.k, args.steps, args.policy, mix, args.decoded))
                print(f"[{len(results)}/{len(args.rows) * len(args.drafts)}] {rows} rows, {drafts}s: "
                      f"{results[-1]['host_ms']:.2f} ms per step", file=sys.stderr, flush=True)
    print_table(results)
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(results), out / "stages.parquet")
    plot(results, out / "host.png")
    worst = {rows: max(r["host_ms"] for r in results if r["rows"] == rows) for rows in args.rows}
    print("host ms per step: " + "; ".join(f"{rows} row{'s' if rows > 1 else ''} {ms:.2f}"
                                           for rows, ms in worst.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
