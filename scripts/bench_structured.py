"""Structured outputs and predicted outputs on the real pair (Qwen2.5-Coder-1.5B-Instruct, the 0.5B as its draft),
one request at a time, side by side in one run, configurations interleaved cycle after cycle:

- mask: llguidance's per-token mask cost on the 151,936-token vocabulary at batch 1 and 8 (xgrammar beside it
  when installed), walking JSON answers token by token;
- json: extraction into a schema with long keys. `off` free and structured (no speculation: what a grammar costs),
  the draft model without and with jump-forward (the tokens the grammar forces, drafted for free);
- edit: rename a variable in a 60-line file; the draft model without and with the file as the prediction.

Prints a table; writes results/structured/bench_structured.json (every request) and bench_structured.png.

    python scripts/bench_structured.py                        # everything, ~12 min on 2 cores
    python scripts/bench_structured.py --parts mask           # the mask cost alone, seconds

Its figures: docs/benchmarks.md, "Structured and predicted outputs"."""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from smartspec import LLM, SamplingParams
from smartspec.bench.report import paired_ratio
from smartspec.engine.profile_cache import cpu_name
from smartspec.policy import OffPolicy
from smartspec.spec_decode.config import SpeculativeConfig
from smartspec.types.sampling_params import StructuredOutput

SCHEMA = {"type": "object", "properties": {
    "customer_full_name": {"type": "string"}, "customer_email_address": {"type": "string"},
    "order_reference_number": {"type": "string"}, "shipping_destination_city": {"type": "string"},
    "requested_delivery_date": {"type": "string"}, "number_of_items_ordered": {"type": "integer"},
    "is_gift_wrapping_requested": {"type": "boolean"}},
    "required": ["customer_full_name", "customer_email_address", "order_reference_number",
                 "shipping_destination_city", "requested_delivery_date", "number_of_items_ordered",
                 "is_gift_wrapping_requested"], "additionalProperties": False}
ORDERS = [
    "Hi, this is Maria Lopez (maria.lopez@example.com). Order A-1042: please send the 3 items to Valencia by "
    "March 3rd. It is a present, so wrap it please.",
    "Order ref ZX-77 from Tom Becker, tom.b@mailbox.org. Two items, ship to Hamburg, needed by 2026-12-20, "
    "no gift wrap.",
    "Customer: Aiko Tanaka <aiko@tanaka.jp>. Reference 5531-B. Deliver 1 item to Osaka on June 1. Gift wrap: yes.",
    "Please ship order #9001 (7 items) to Toronto before Friday the 14th. Name: Sam O'Neil, sam@oneil.ca. "
    "Not a gift.",
    "From: Priya Natarajan (priya.n@corp.in). Order PN-3 - 4 items to Chennai, date 15 Aug, gift wrapped please.",
    "Lukas Novak here, lukas.novak@seznam.cz, order CZ-2210, 12 items for Prague, any day next week, no wrapping.",
]


def edit_file(seed: int) -> str:
    """A 60-line Python module that uses the variable `total` throughout."""
    lines = [f'"""Accounting helpers, module {seed}."""', "", "", "def summarize(records):", "    total = 0"]
    for i in range(26):
        lines += [f"    if records[{i}].kind == 'k{(i * 7 + seed) % 11}':",
                  f"        total += records[{i}].amount * {i % 5 + 1}"]
    lines += ["    return total", "", "", "def average(records):",
              "    total = summarize(records)", "    return total / max(len(records), 1)"]
    return "\n".join(lines[:60]) + "\n"


def mask_cost(tokenizer, vocab_size: int, texts: list[str]) -> list[dict]:
    """ms per token of computing the next-token mask, walking each text's tokens (batch b: b matchers a step)."""
    import llguidance
    import llguidance.hf
    import llguidance.torch

    from smartspec.structured.compile import grammar_of

    grammar, _ = grammar_of(StructuredOutput(json=SCHEMA))
    rows = []
    llg_tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    for batch in (1, 8):
        ms = []
        for text in texts:
            ids = tokenizer(text, add_special_tokens=False).input_ids
            matchers = [llguidance.LLMatcher(llg_tok, grammar) for _ in range(batch)]
            mask = llguidance.torch.allocate_token_bitmask(batch, vocab_size)
            t0 = time.perf_counter()
            for tok in ids:
                for i, m in enumerate(matchers):
                    llguidance.torch.fill_next_token_bitmask(m, mask, i)
                    assert m.consume_token(tok), m.get_error()
            ms.append(1000 * (time.perf_counter() - t0) / len(ids))
        rows.append({"library": "llguidance", "batch": batch, "ms_per_step": statistics.mean(ms),
                     "ms_per_token": statistics.mean(ms) / batch})
    try:
        import xgrammar as xgr
    except ImportError:
        return rows
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size))
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                            separators=(", ", ": "))
    for batch in (1, 8):
        ms = []
        for text in texts:
            ids = tokenizer(text, add_special_tokens=False).input_ids
            matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
            mask = xgr.allocate_token_bitmask(batch, vocab_size)
            t0 = time.perf_counter()
            for tok in ids:
                for i, m in enumerate(matchers):
                    m.fill_next_token_bitmask(mask, i)
                    assert m.accept_token(tok)
            ms.append(1000 * (time.perf_counter() - t0) / len(ids))
        rows.append({"library": "xgrammar", "batch": batch, "ms_per_step": statistics.mean(ms),
                     "ms_per_token": statistics.mean(ms) / batch})
    return rows


def run_one(llm: LLM, prompt: str, params: SamplingParams) -> dict:
    t0 = time.perf_counter()
    out = llm.generate(prompt, params)[0]
    wall = time.perf_counter() - t0
    spec = out.speculation or {}
    decode_s = max(out.latency_s - out.ttft_s, 1e-9)
    return {"latency_s": wall, "tokens": len(out.token_ids),
            "tpot_ms": 1000 * decode_s / max(len(out.token_ids) - 1, 1),
            "acceptance": spec.get("acceptance_rate"), "accepted_prediction_tokens": spec.get(
                "accepted_prediction_tokens"), "text": out.text, "finish_reason": out.finish_reason}


def configure(llm: LLM, policy, hints: bool) -> None:
    llm.engine.set_speculation(policy=policy)
    llm.engine.request_hints = hints


def arguments() -> argparse.ArgumentParser:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--parts", nargs="+", default=["mask", "json", "edit"], choices=["mask", "json", "edit"])
    ap.add_argument("--cycles", type=int, default=2)
    ap.add_argument("--k", type=int, default=4, help="K: the most tokens a request speculates in a step")
    ap.add_argument("--num-json", type=int, default=len(ORDERS))
    ap.add_argument("--num-edits", type=int, default=2)
    ap.add_argument("--out", default="results/structured")
    return ap


def main() -> None:
    ap = arguments()
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {"cpu": cpu_name(), "date": time.strftime("%Y-%m-%d"), "target": args.target, "draft": args.draft,
               "k": args.k}
    spec = SpeculativeConfig(method="draft_model", model=args.draft, num_speculative_tokens=args.k, policy="smartspec")
    llm = LLM(args.target, speculative_config=spec, max_model_len=2048, kv_cache_gib=1.0)
    tok = llm.tokenizer
    smartspec_policy, off = llm.engine.speculation.policy, OffPolicy()

    def chat(text: str) -> str:
        return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)

    if "mask" in args.parts:
        answers = [json.dumps({k: ("x" * 12 if v.get("type") == "string" else 3 if v.get("type") == "integer"
                                   else True) for k, v in SCHEMA["properties"].items()})] * 3
        results["mask"] = mask_cost(tok, llm.engine.vocab_size, answers)
        for r in results["mask"]:
            print(f"mask {r['library']:10s} batch {r['batch']}: {r['ms_per_step']:.3f} ms a step, "
                  f"{r['ms_per_token']:.4f} ms a token", flush=True)
    runs = []
    if "json" in args.parts:
        structured = StructuredOutput(json=SCHEMA)
        configs = [("off free", off, False, None), ("off structured", off, False, structured),
                   ("draft", smartspec_policy, False, structured), ("draft + jump-forward", smartspec_policy, True,
                                                                    structured)]
        prompts = [chat("Extract the order as JSON with the keys customer_full_name, customer_email_address, "
                        "order_reference_number, shipping_destination_city, requested_delivery_date, "
                        f"number_of_items_ordered, is_gift_wrapping_requested.\n\n{o}") for o in ORDERS]
        runs += bench(llm, "json", configs, prompts[:args.num_json], args.cycles, 160)
    if "edit" in args.parts:
        files = [edit_file(s) for s in range(args.num_edits)]
        configs = [("off", off, False, None), ("draft", smartspec_policy, False, None),
                   ("draft + prediction", smartspec_policy, True, None)]
        prompts = [chat("Rename the variable `total` to `running_sum` in this file. Reply with the whole file and "
                        f"nothing else.\n\n```python\n{f}```") for f in files]
        runs += bench(llm, "edit", configs, prompts, args.cycles, 700,
                      predictions=[f"```python\n{f}```" for f in files])
    results["runs"] = runs
    (out_dir / "bench_structured.json").write_text(json.dumps(results, indent=1))
    if runs:
        report(runs, results, out_dir)


def bench(llm, workload, configs, prompts, cycles, max_tokens, predictions=None) -> list[dict]:
    rows = []
    for cycle in range(cycles):
        for i, prompt in enumerate(prompts):
            for label, policy, hints, structured in configs:  # interleaved: each prompt under every config in turn
                configure(llm, policy, hints)
                pred = predictions[i] if predictions and hints else None
                params = SamplingParams(max_tokens=max_tokens, structured=structured, prediction=pred)
                row = run_one(llm, prompt, params)
                rows.append({"workload": workload, "config": label, "cycle": cycle, "prompt": i, **row})
                print(f"{workload} cycle {cycle} prompt {i} {label:22s} {row['latency_s']:6.2f} s "
                      f"{row['tokens']:4d} tok  TPOT {row['tpot_ms']:6.1f} ms", flush=True)
    return rows


def report(runs: list[dict], results: dict, out_dir: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    print(f"\n{results['target']} + {results['draft']}, one request at a time; {results['cpu']}, {results['date']}")
    print(f"{'workload':8s} {'config':22s} {'latency s':>9s} {'tokens':>7s} {'TPOT ms':>8s} {'vs base':>16s}")
    summary = []
    for workload in dict.fromkeys(r["workload"] for r in runs):
        rows = [r for r in runs if r["workload"] == workload]
        labels = list(dict.fromkeys(r["config"] for r in rows))
        base = "draft" if "draft" in labels else labels[0]
        for label in labels:
            mine = [r for r in rows if r["config"] == label]
            ratios = [b["latency_s"] / r["latency_s"] for r in mine for b in rows
                      if b["config"] == base and (b["cycle"], b["prompt"]) == (r["cycle"], r["prompt"])]
            speedup, se = paired_ratio(ratios)
            lat = statistics.mean(r["latency_s"] for r in mine)
            tpot = statistics.mean(r["tpot_ms"] for r in mine)
            summary.append({"workload": workload, "config": label, "latency_s": lat, "tpot_ms": tpot,
                            "speedup_vs_" + base: speedup, "se": se})
            print(f"{workload:8s} {label:22s} {lat:9.2f} {statistics.mean(r['tokens'] for r in mine):7.0f} "
                  f"{tpot:8.1f} {speedup:8.2f}x ±{100 * se:4.1f}%")
    results["summary"] = summary
    (out_dir / "bench_structured.json").write_text(json.dumps(results, indent=1))
    fig, ax = plt.subplots(figsize=(8, 3.5))
    names = [f"{s['workload']}: {s['config']}" for s in summary]
    ax.barh(names, [s["latency_s"] for s in summary], color="tab:blue")
    ax.set_xlabel("mean latency per request (s)")
    ax.invert_yaxis()
    ax.set_title(f"structured and predicted outputs, {results['target']}, {results['cpu'][:40]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out_dir / "bench_structured.png", dpi=120)


if __name__ == "__main__":
    main()
