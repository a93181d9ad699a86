"""SmartSpec on a GPU in one command: step speed, speculation and the lossless checks on random-weight models of the
default pair's shapes (a Qwen2.5-1.5B-shaped target; no model files travel, nothing is downloaded).

The draft agrees with the target by construction: the target's layers past the first four write nothing into the
residual stream (they still cost their full compute), and the draft is those four layers with noise on every
weight, its strength picked so that the draft's greedy agreement with the target is nearest --agreement (0.9).

    python scripts/bench_gpu.py                         # on a GPU: bf16, 1 and 64 streams (a few minutes)
    python scripts/bench_gpu.py --device cpu --tiny     # the script itself on a CPU, tiny shapes (about 15 s)

Rows: plain decoding, fixed k = 4 and the goodput policy (smartspec) at each batch, transformers' own `generate`
beside them. Every configuration runs once untimed first (so each bucket's graph is captured before any run is
timed), then the three are interleaved over --repeats rounds; the table gives medians, the speed's spread and the
median of each round's ratio to plain decoding. Then the cost of verifying k + 1 = 5 tokens against one, greedy
speculation against plain decoding (in the run's dtype and in float32; each parting diagnosed as a near-tie or a
wrong token), and sampled speculation with chains and trees. "steady" counts decode steps without a prefill chunk
or a draft catching up on a prompt. Prints the table; writes <out>/bench_gpu.json (every number) and
<out>/bench_gpu.png (the policy's fitted step time by batched tokens, beside the measured steps).
Its figures: docs/benchmarks.md, "On a GPU"."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {"full": (1536, 28, 12, 2, 8960, 151936), "tiny": (64, 6, 4, 2, 128, 384)}  # hidden, layers, heads, kv, mlp, V
DRAFT_LAYERS = 4
K = 4


def byte_tokenizer():
    """A byte-level tokenizer (256 bytes + <eos>) built offline; the models' vocabularies are padded past it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<eos>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def build(args, work: Path) -> dict:
    """Save the target and the calibrated shallow draft under `work`; return what was built."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    hidden, layers, heads, kv, mlp, vocab = SHAPES["tiny" if args.tiny else "full"]
    tok = byte_tokenizer()
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=4096,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id, rms_norm_eps=1e-6,
                      initializer_range=0.02 if not args.tiny else 0.3)
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        target = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval().requires_grad_(False)
        for layer in target.model.layers[DRAFT_LAYERS:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        cfg_draft = Qwen2Config(**{**cfg.to_dict(), "num_hidden_layers": DRAFT_LAYERS, "layer_types": None})
        draft = AutoModelForCausalLM.from_config(cfg_draft, dtype=torch.float32).eval().requires_grad_(False)
    draft.load_state_dict(target.state_dict(), strict=False)
    clean = [p.detach().clone() for p in draft.parameters()]

    def perturb(alpha: float) -> None:
        g = torch.Generator(device=args.device).manual_seed(args.seed + 1)
        for p, c in zip(draft.parameters(), clean):
            std = float(c.std()) if c.numel() > 1 else 0.0
            p.copy_(c + alpha * std * torch.randn(c.shape, generator=g, device=c.device) if std > 0 else c)

    # the draft's greedy agreement with the target on the target's own continuations (teacher-forced)
    prompts = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(5)).to(args.device)
    seqs = target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=32, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        want = target(seqs).logits[:, 31:-1].argmax(-1)
        agreement = {}
        for alpha in (0.0, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2):
            perturb(alpha)
            agreement[alpha] = float((draft(seqs).logits[:, 31:-1].argmax(-1) == want).float().mean())
        alpha = min(agreement, key=lambda a: (abs(agreement[a] - args.agreement), -a))
        perturb(alpha)
    for name, model in (("target", target), ("draft", draft)):
        model.generation_config.eos_token_id = tok.eos_token_id
        model.save_pretrained(work / name)
        tok.save_pretrained(work / name)
    params = sum(p.numel() for p in target.parameters()) / 1e6
    return {"target": str(work / "target"), "draft": str(work / "draft"), "target_params_M": round(params, 1),
            "alpha": alpha, "agreement_by_alpha": agreement, "agreement": agreement[alpha]}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class PolicyClock:
    """The host seconds a policy's plan and observe calls take, counted while installed on the policy instance
    (the engine calls both on the step's critical path: plan before the forward, observe after the tokens). The
    engine reads `speculation.policy` anew each step, so the instance's own attributes are what it calls."""

    def __init__(self, policy) -> None:
        self.policy, self.seconds = policy, 0.0

    def __enter__(self) -> PolicyClock:
        for name in ("plan", "observe"):
            setattr(self.policy, name, self._timed(getattr(type(self.policy), name).__get__(self.policy)))
        return self

    def __exit__(self, *exc) -> None:
        for name in ("plan", "observe"):
            delattr(self.policy, name)

    def _timed(self, call):
        def timed(*args):
            began = time.perf_counter()
            try:
                return call(*args)
            finally:
                self.seconds += time.perf_counter() - began
        return timed


def run(engine, prompts, params, cap_s: float, buckets=lambda: 0) -> dict:
    """All prompts at once, stepped until done or cap_s of steady steps; what is left is aborted. buckets(): the
    buckets the runners hold; a step that added one (a graph captured and checked) is not steady. A step's seconds
    are the wall time of engine.step() (the policy's observe included, which the step record's total_s is not);
    policy_s, the policy's own share of them (PolicyClock)."""
    ids = [engine.add_request(p, params) for p in prompts]
    steps, t0, done = [], time.perf_counter(), set()
    with PolicyClock(engine.speculation.policy) as clock:
        while engine.has_unfinished():
            if sum(s["s"] for s in steps if s["steady"]) >= cap_s:
                break
            before, held, policy_before = engine.num_steps, buckets(), clock.seconds
            began = time.perf_counter()
            outs = engine.step()
            wall = time.perf_counter() - began
            done.update(o.request_id for o in outs if o.finished)
            if engine.num_steps == before:  # nothing was scheduled: no new record
                continue
            r = engine.last_step
            captured = buckets() > held
            steps.append({"s": wall, "policy_s": clock.seconds - policy_before, "captured": captured,
                          "steady": (r.num_prefill_tokens == 0 and r.draft_catchup_tokens <= r.batch_size
                                     and not captured),
                          "new": sum(1 + a for a in r.accepted), "ks": list(r.ks), "tokens": r.num_batched_tokens,
                          # all but drafting, as the cost model's T_verify: on a GPU the forward returns before its
                          # kernels finish, and the step waits for them when it reads the tokens
                          "verify_s": r.total_s - r.draft_s,
                          "context": r.num_context_tokens})
    for rid in ids:
        if rid not in done:
            engine.abort_request(rid)
    steady = [s for s in steps if s["steady"]]
    seconds = sum(s["s"] for s in steady)
    ks = [k for s in steady for k in s["ks"]]
    return {"steady_tok_s": sum(s["new"] for s in steady) / seconds if seconds else None,
            "ms_per_step": 1000 * seconds / len(steady) if steady else None,
            "policy_ms_per_step": 1000 * sum(s["policy_s"] for s in steady) / len(steady) if steady else None,
            "tokens_per_step": sum(s["new"] for s in steady) / len(steady) if steady else None,
            "mean_k": statistics.fmean(ks) if ks else None, "steady_steps": len(steady),
            "wall_s": time.perf_counter() - t0, "steps": steps}


def captured_graphs(engine, proposer) -> int:
    """Buckets the target's and the draft's runners hold (captured graphs on a GPU, padded steps elsewhere)."""
    from smartspec.runtime.cuda_graphs import GraphBackend
    runners = [engine.runner, getattr(proposer, "runner", None)]
    return sum(len(r.backend.steps) for r in runners if r is not None and isinstance(r.backend, GraphBackend))


def summarize(repeats: list[dict], off: list[dict]) -> dict:
    """One configuration's interleaved repeats: medians, the spread of its speed, and its speed over plain
    decoding's within each repeat (a ratio never crosses repeats)."""
    speeds = [r["steady_tok_s"] for r in repeats if r["steady_tok_s"]]
    ratios = [r["steady_tok_s"] / o["steady_tok_s"] for r, o in zip(repeats, off)
              if r["steady_tok_s"] and o["steady_tok_s"]]

    def median(key):
        values = [r[key] for r in repeats if r[key] is not None]
        return statistics.median(values) if values else None
    return {"steady_tok_s": statistics.median(speeds) if speeds else None,
            "tok_s_min": min(speeds, default=None), "tok_s_max": max(speeds, default=None),
            "vs_off": statistics.median(ratios) if ratios else None, "vs_off_each": ratios,
            "ms_per_step": median("ms_per_step"), "policy_ms_per_step": median("policy_ms_per_step"),
            "tokens_per_step": median("tokens_per_step"),
            "mean_k": median("mean_k"), "captures": sum(r["captures"] for r in repeats),
            "repeats": len(repeats), "steps": [s for r in repeats for s in r["steps"]]}


def step_cost(engine, device: str, context: int, reps: int) -> dict:
    """The target's forward of 1 and of K + 1 tokens of one sequence over `context` cached tokens, median ms."""
    from smartspec.runtime.model_runner import ForwardItem
    from smartspec.types.request import Request
    from smartspec.types.sampling_params import SamplingParams

    r = Request("cost", list(range(3, 3 + context + K + 1)), SamplingParams())
    engine.blocks.allocate(r, context + K + 1)
    try:
        engine.runner.forward([ForwardItem(r, r.token_ids[:context], 0, 1)])
        out = {}
        for n in (1, K + 1, 1, K + 1):  # each shape twice: the first pass warms it up
            samples = []
            for _ in range(reps):
                sync(device)
                t = time.perf_counter()
                engine.runner.forward([ForwardItem(r, r.token_ids[context:context + n], context, n)])
                sync(device)
                samples.append(time.perf_counter() - t)
            out[n] = 1000 * statistics.median(samples)
        return {"one_token_ms": out[1], "verify_ms": out[K + 1], "ratio": out[K + 1] / out[1]}
    finally:
        engine.blocks.free(r)


NEAR_TIE = {"float32": 1e-3, "bfloat16": 2e-2, "float16": 1e-2}  # top-2 gap, as a fraction of the logit scale


def lossless(path: str, device: str, dtype: str, prompts, plain, speculative) -> dict:
    """Greedy speculative outputs against plain ones. Where a pair parts, transformers' own model (same dtype) is
    asked how far apart the two tokens' logits are there: within NEAR_TIE of the logit scale is a floating-point
    near-tie (two correct runs may part there), anything else a wrong token."""
    from transformers import AutoModelForCausalLM

    partings = []
    model = None
    for prompt, a, b in zip(prompts, plain, speculative):
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if at is None:
            continue
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
        with torch.no_grad():
            logits = model(torch.tensor([prompt + a[:at]], device=device)).logits[0, -1].float()
        gap = float((logits[a[at]] - logits[b[at]]).abs() / logits.abs().max())
        partings.append({"at": at, "tokens": [a[at], b[at]], "gap": gap, "near_tie": gap < NEAR_TIE[dtype]})
    return {"equal": len(prompts) - len(partings), "near_ties": sum(p["near_tie"] for p in partings),
            "wrong": sum(not p["near_tie"] for p in partings), "partings": partings}


def hf_speed(path: str, device: str, dtype, batch: int, prompt_len: int, max_new: int) -> float:
    """transformers' own generate, same model and batch: new tokens per second."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    ids = torch.randint(0, 256, (batch, prompt_len), generator=torch.Generator().manual_seed(9)).to(device)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generate(ids, max_new_tokens=4, **kw)  # warm-up
    sync(device)
    t = time.perf_counter()
    model.generate(ids, max_new_tokens=max_new, **kw)
    sync(device)
    return batch * max_new / (time.perf_counter() - t)


def arguments() -> argparse.ArgumentParser:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: check the script itself on a CPU")
    ap.add_argument("--batches", default="1,64", help="streams decoding at once, comma-separated")
    ap.add_argument("--max-new", type=int, default=64, help="new tokens per request")
    ap.add_argument("--cap-s", type=float, default=5.0, help="steady seconds per run at most")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every configuration")
    ap.add_argument("--agreement", type=float, default=0.9, help="the draft's greedy agreement to calibrate to")
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results")
    return ap


def checked_args(argv) -> tuple[argparse.Namespace, list[int]]:
    """The command line's arguments, and its batches, or a usage error."""
    ap = arguments()
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no GPU here (use --device cpu --tiny to check the script)")
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        ap.error(f"--batches: comma-separated integers, got {args.batches!r}")
    if args.repeats < 1:
        ap.error(f"--repeats: at least 1, got {args.repeats}")
    return args, batches


def main(argv=None) -> int:
    args, batches = checked_args(argv)
    # the device's image runs the checkout as it is, not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from smartspec import SamplingParams
    from smartspec.policy.factory import make_policy
    from smartspec.runtime.attention import attention_kernels
    from smartspec.spec_decode.config import SpeculativeConfig
    from smartspec.spec_decode.factory import draft_blocks, make_draft_proposer

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="smartspec_bench_gpu_"))
    print(f"building random-weight models in {work} ...", flush=True)
    built = build(args, work)
    print(f"target {built['target_params_M']}M params; draft {DRAFT_LAYERS} layers, noise {built['alpha']:g}: "
          f"agreement {built['agreement']:.2f}", flush=True)
    results = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
               "torch": torch.__version__, "args": vars(args), "built": built, "runs": {}}
    engine = engine_for(built, args, max(batches), args.dtype)
    results["dtype"] = engine.config.dtype
    results["backend"] = engine.runner.backend.name
    spec = SpeculativeConfig.parse({"method": "draft_model", "model": built["draft"], "num_speculative_tokens": K})
    blocks = draft_blocks(spec, engine.blocks.num_blocks, engine.config.max_num_seqs, engine.blocks.blocks_for)
    proposer = make_draft_proposer(spec, engine.draft_runtime(blocks, spec))
    gen = torch.Generator().manual_seed(args.seed)

    def prompts(n: int) -> list[list[int]]:
        return torch.randint(0, 256, (n, 17), generator=gen).tolist()

    smart = make_policy("smartspec", K, key="bench-gpu")
    engine.set_speculation(proposer, smart, K)
    engine.profile_steps()  # the batches a served engine's start profiles on this runner, up to max(batches)
    print("the step cost of 1 and 5 tokens ...", flush=True)
    results["step_cost"] = step_cost(engine, args.device, 200, 5 if args.tiny else 20)
    greedy = SamplingParams(max_tokens=args.max_new, ignore_eos=True)
    timed_runs(engine, proposer, smart, batches, prompts, greedy, args, results)
    results["graphs_captured"] = captured_graphs(engine, proposer)
    results["attention_kernels"] = attention_kernels()  # CUDA: the SDPA kernel each kind of call runs on
    check_outputs(engine, built, spec, blocks, prompts(8), args, results)
    results["cost_model"] = fitted_costs(results, smart)
    results["elapsed_s"] = time.perf_counter() - t_start
    (out_dir / "bench_gpu.json").write_text(json.dumps(results, indent=1, default=str))
    print_table(results, batches)
    plot(results, out_dir / "bench_gpu.png")
    print(f"\nwrote {out_dir / 'bench_gpu.json'} and {out_dir / 'bench_gpu.png'}")
    return 0


def engine_for(built: dict, args, rows: int, dtype: str):
    """The engine over the built target, sized for `rows` streams."""
    from smartspec import EngineConfig
    from smartspec.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(
        model=built["target"], device=args.device, dtype=dtype, use_kernels=False, quantization=None,
        max_num_seqs=rows, max_num_batched_tokens=max(2048, rows * (K + 1)),
        kv_cache_gib=8.0 if args.device.startswith("cuda") else 0.25, max_model_len=1024,
        warmup_profile=False, cuda_graphs=not args.no_cuda_graphs))


def timed_runs(engine, proposer, smart, batches: list[int], prompts, greedy, args, results: dict) -> None:
    """off, fixed k = K and smartspec at each batch, interleaved over the repeats, into results["runs"]; and
    transformers' generate at each batch for reference."""
    from smartspec.policy.factory import make_policy

    configs = [("off", make_policy("off", K)), (f"fixed:{K}", make_policy(f"fixed:{K}", K)), ("smartspec", smart)]
    for b in batches:
        # every configuration's buckets captured before any is timed; a bucket first met later is captured in a
        # step that is not counted as steady
        for name, policy in configs:
            engine.set_speculation(proposer, policy, K)
            run(engine, prompts(b), greedy, args.cap_s)
        repeats: dict[str, list[dict]] = {name: [] for name, _ in configs}
        for rep in range(args.repeats):  # interleaved: A B C A B C ..., so drift falls on every configuration
            for name, policy in configs:
                engine.set_speculation(proposer, policy, K)
                r = run(engine, prompts(b), greedy, args.cap_s, lambda: captured_graphs(engine, proposer))
                r["captures"] = sum(s["captured"] for s in r["steps"])
                repeats[name].append(r)
        for name, _ in configs:
            r = summarize(repeats[name], repeats["off"])
            results["runs"][f"b={b} {name}"] = r
            print(f"b={b} {name}: {r['steady_tok_s'] or 0:.1f} tok/s steady (median of {args.repeats}, "
                  f"{r['tok_s_min'] or 0:.1f}-{r['tok_s_max'] or 0:.1f}), {r['ms_per_step'] or 0:.1f} ms a step "
                  f"({r['policy_ms_per_step'] or 0:.2f} in the policy), mean k {r['mean_k'] or 0:.2f}, "
                  f"{r['captures']} captures while timed", flush=True)
        dt = getattr(torch, engine.config.dtype)
        results["runs"][f"b={b} transformers generate"] = {
            "steady_tok_s": hf_speed(results["built"]["target"], args.device, dt, b, 17, min(args.max_new, 64))}


def outputs(eng, policy, ps, params, k_max: int = K) -> list[list[int]]:
    """Each prompt's output tokens, the prompts decoded together under `policy`."""
    eng.set_speculation(eng.speculation.proposer, policy, k_max)
    ids = [eng.add_request(p, params) for p in ps]
    got = {}
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id] = list(o.token_ids)
    return [got[i] for i in ids]


def check_outputs(engine, built: dict, spec, blocks: int, check: list[list[int]], args, results: dict) -> None:
    """Lossless: greedy speculation against plain decoding on `check` (the same batch composition), in the run's
    dtype and, where that is not fp32, in fp32 (whose contract is bitwise); sampled chains and trees, seeded, run
    and repeat themselves."""
    from smartspec import SamplingParams
    from smartspec.policy.factory import make_policy
    from smartspec.spec_decode.config import SpeculativeConfig
    from smartspec.spec_decode.factory import draft_blocks, make_draft_proposer

    short = SamplingParams(max_tokens=32, ignore_eos=True)
    plain = outputs(engine, make_policy("off", K), check, short)
    spec_out = outputs(engine, make_policy(f"fixed:{K}", K), check, short)
    results["lossless"] = {results["dtype"]: lossless(built["target"], args.device, results["dtype"], check, plain,
                                                      spec_out)}
    sampled = SamplingParams(max_tokens=16, temperature=0.8, seed=7)
    chains = [outputs(engine, make_policy(f"fixed:{K}", K), check[:2], sampled) for _ in range(2)]
    tree_spec = SpeculativeConfig.parse({"method": "draft_model", "model": built["draft"], "num_speculative_tokens": 8,
                                         "tree": {"max_nodes": 8, "max_depth": 3, "branching": 2}})
    tree_blocks = draft_blocks(tree_spec, engine.blocks.num_blocks, engine.config.max_num_seqs,
                               engine.blocks.blocks_for)
    engine.set_speculation(make_draft_proposer(tree_spec, engine.draft_runtime(tree_blocks, tree_spec)),
                           make_policy("fixed:8", 8), 8)
    trees = [outputs(engine, make_policy("fixed:8", 8), check[:2], sampled, k_max=8) for _ in range(2)]
    results["sampled"] = {"chain_repeats": chains[0] == chains[1], "tree_repeats": trees[0] == trees[1],
                          "tree_accepted": engine.speculation.metrics.num_accepted_tokens}
    if results["dtype"] != "float32":
        fp32 = engine_for(built, args, engine.config.max_num_seqs, "float32")
        fp32.set_speculation(make_draft_proposer(spec, fp32.draft_runtime(blocks, spec)), make_policy("off", K), K)
        plain = outputs(fp32, make_policy("off", K), check, short)
        spec_out = outputs(fp32, make_policy(f"fixed:{K}", K), check, short)
        results["lossless"]["float32"] = lossless(built["target"], args.device, "float32", check, plain, spec_out)


def fitted_costs(results: dict, smart) -> dict:
    """The fitted step time by batched tokens, at the context per token the measured steady steps had."""
    steady = [s for r in results["runs"].values() for s in r.get("steps", []) if s["steady"]]
    per_token = statistics.median(s["context"] / s["tokens"] for s in steady)
    return {"coefficients": smart.stats().get("cost_coefficients"), "context_per_token": per_token,
            "predicted_ms": {n: 1000 * s for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 320)
                             if (s := smart.load.step_seconds(n, round(n * per_token))) is not None}}


def print_table(results: dict, batches: list[int]) -> None:
    runs = results["runs"]
    print(f"\nSmartSpec on {results['device']} ({results['dtype']}, {results['backend']}), torch {results['torch']}; "
          f"draft agreement {results['built']['agreement']:.2f}; {results['args']['repeats']} interleaved repeats "
          f"after a warm-up of every configuration, medians")
    print(f"{'run':30s} {'steady tok/s':>12s} {'min-max':>15s} {'ms/step':>8s} {'policy':>6s} {'tok/step':>8s} "
          f"{'mean k':>6s} {'vs off':>6s} {'captures':>8s}")

    def f(x, fmt):
        return format(x, fmt) if x is not None else format("-", ">" + fmt.split(".")[0].rstrip("d"))
    for b in batches:
        for name in ("off", f"fixed:{K}", "smartspec", "transformers generate"):
            r = runs[f"b={b} {name}"]
            spread = (f"{r['tok_s_min']:.1f}-{r['tok_s_max']:.1f}" if r.get("tok_s_min") is not None else "-")
            vs_off = r.get("vs_off") if name != "transformers generate" else (
                r["steady_tok_s"] / runs[f"b={b} off"]["steady_tok_s"] if runs[f"b={b} off"]["steady_tok_s"]
                else None)
            print(f"{f'b={b} {name}':30s} {f(r['steady_tok_s'], '12.1f')} {spread:>15s} "
                  f"{f(r.get('ms_per_step'), '8.1f')} {f(r.get('policy_ms_per_step'), '6.2f')} "
                  f"{f(r.get('tokens_per_step'), '8.2f')} "
                  f"{f(r.get('mean_k'), '6.2f')} {f(vs_off, '6.2f')} {f(r.get('captures'), '8d')}")
    print("ms/step: wall time of a steady step, the policy's plan and observe included (policy: their share)")
    print(f"buckets held by the target's and the draft's runners: {results['graphs_captured']} "
          f"(captures: steps of a timed run that captured one, left out of its steady figures); attention kernels: "
          f"{results['attention_kernels'] or 'the torch path off CUDA'}")
    c = results["step_cost"]
    print(f"\nverify {K + 1} tokens of one stream: {c['verify_ms']:.2f} ms, {c['ratio']:.2f}x a one-token step "
          f"({c['one_token_ms']:.2f} ms)")
    for dtype, r in results["lossless"].items():
        print(f"greedy speculation == plain decoding, {dtype}: {r['equal']}/8 equal, {r['near_ties']} parted at a "
              f"near-tie (top-2 gap < {NEAR_TIE[dtype]:g} x the logit scale), {r['wrong']} wrong")
    print(f"sampled speculation, seeded, repeats itself: {results['sampled']}")


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in results["runs"].items():
        steps = [s for s in r.get("steps", []) if s["steady"]]
        if steps:
            ax.scatter([s["tokens"] for s in steps], [1000 * s["verify_s"] for s in steps], s=8, label=name)
    predicted = results["cost_model"]["predicted_ms"]
    if predicted:
        xs = sorted(int(n) for n in predicted)
        ax.plot(xs, [predicted[n] for n in xs], "k-",
                label=f"fitted ({results['cost_model']['context_per_token']:.0f} context tokens a token)")
    ax.set(xscale="log", yscale="log", xlabel="tokens in the target's forward", ylabel="step ms without drafting",
           title=f"step cost on {results['device']} ({results['dtype']})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
