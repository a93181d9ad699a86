"""`smartspec` command line: models list|fetch, generate, sim, bench serve."""
from __future__ import annotations

import argparse
import sys


def _models(args) -> int:
    from smartspec.models import BUNDLED, ModelFetchError, fetch
    from smartspec.models.registry import is_fetched, model_dir

    if args.action == "list":
        for name, spec in BUNDLED.items():
            state = f"fetched: {model_dir(name)}" if is_fetched(name) else "not fetched"
            print(f"{name:22s} {spec.description}\n{'':22s} {state}")
        return 0
    try:
        for name in args.names:
            print(fetch(name, force=args.force, dense=args.dense))
    except ModelFetchError as exc:
        print(f"smartspec: error: {exc}", file=sys.stderr)
        return 1
    return 0


def _generate(args) -> int:
    from smartspec.llm import LLM
    from smartspec.types.sampling_params import SamplingParams

    llm = LLM(args.model, kv_cache_gib=args.kv_cache_gib, max_model_len=args.max_model_len)
    prompt = args.prompt
    if args.chat and llm.tokenizer.chat_template:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                   add_generation_prompt=True)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed)
    out = llm.generate(prompt, params)[0]
    print(out.text)
    n = len(out.token_ids)
    decode_s = max(out.latency_s - out.ttft_s, 1e-9)
    print(f"[{n} tokens, finish={out.finish_reason}, ttft {out.ttft_s:.2f} s, "
          f"{(n - 1) / decode_s:.1f} tok/s after the first]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="smartspec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("models", help="list or fetch the bundled models")
    m.add_argument("action", choices=["list", "fetch"])
    m.add_argument("names", nargs="*", help="models to fetch")
    m.add_argument("--force", action="store_true", help="fetch again")
    m.add_argument("--dense", action="store_true",
                   help="also convert to fp32 safetensors now (else on the first load with quantization None)")
    g = sub.add_parser("generate", help="generate from one prompt with the offline engine")
    g.add_argument("prompt")
    g.add_argument("--model", default="qwen2.5-coder-1.5b")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--kv-cache-gib", type=float, default=1.0)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-chat", dest="chat", action="store_false", help="send the prompt raw, no chat template")
    from smartspec.sim.cli import add_arguments as sim_arguments

    sim_arguments(sub.add_parser("sim", help="simulate latency vs rate per policy from measured step traces"))
    from smartspec.bench.cli import add_arguments as bench_serve_arguments

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="benchmark", required=True)
    bench_serve_arguments(bench.add_parser(
        "serve", help="drive an OpenAI-compatible server with Poisson arrivals: latency, TTFT, TPOT, acceptance"))
    args = parser.parse_args(argv)
    if args.command == "models" and args.action == "fetch" and not args.names:
        parser.error("models fetch needs at least one model name")
    try:
        if args.command == "sim":
            from smartspec.sim.cli import run
            return run(args)
        if args.command == "bench":
            from smartspec.bench.cli import run
            return run(args)
        return _models(args) if args.command == "models" else _generate(args)
    except ValueError as exc:
        print(f"smartspec: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
