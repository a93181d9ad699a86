"""lm-eval against a running server, scored again by the offline engine: the check that a third-party eval client
gets from the server exactly what the engine computes.

Two tasks built from local files (HumanEval; no hub): "which function does this docstring describe" as a
loglikelihood multiple choice (`local-completions`: echo + logprobs over token-id prompts), and "name the function
defined here" as a chat generate_until (`local-chat-completions`). lm-eval runs in its own virtualenv (it pins
packages of its own): make one with `python3 -m venv .venv-lmeval && .venv-lmeval/bin/pip install torch==2.13.0
"lm_eval[api]==0.4.13" transformers==5.23.0`. Then, with `serve run config.yaml` answering on :8000:

    python scripts/lm_eval_check.py --lm-eval .venv-lmeval/bin/lm_eval --docs 20

Prints lm-eval's scores beside the offline engine's and how many per-sample values agree bit for bit; writes
results/lm_eval/ (lm-eval's outputs and samples, check.parquet). Its figures: docs/serving.md, "Third-party clients"."""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

from smartspec import LLM, SamplingParams
from smartspec.bench.workloads import humaneval_problems
from smartspec.models.registry import resolve

MC_TEXT = "{{question}}\nThe function's name is"
GEN_TEXT = "What is the name of the Python function defined below? Answer with the name only.\n\n{{code}}"


def docstring_of(prompt: str) -> str:
    """The problem's text without its def line (the name is what is asked)."""
    lines = [line for line in prompt.splitlines() if not line.lstrip().startswith("def ")]
    return "\n".join(lines).strip()


def write_tasks(folder: Path, docs: int, seed: int) -> None:
    problems = humaneval_problems()[:docs]
    names = [p["entry_point"] for p in humaneval_problems()]
    rng = random.Random(seed)
    mc, gen = [], []
    for p in problems:
        wrong = rng.sample([n for n in names if n != p["entry_point"]], 3)
        choices = wrong + [p["entry_point"]]
        rng.shuffle(choices)
        mc.append({"question": docstring_of(p["prompt"]), "choices": [" " + c for c in choices],
                   "answer": choices.index(p["entry_point"])})
        gen.append({"code": p["prompt"] + p["canonical_solution"], "answer": p["entry_point"]})
    folder.mkdir(parents=True, exist_ok=True)
    for name, rows in (("mc", mc), ("gen", gen)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {path}\ntest_split: test\n"
    (folder / "smartspec_names_mc.yaml").write_text(
        "task: smartspec_names_mc\n" + common.format(path=folder / "mc.jsonl") +
        f"output_type: multiple_choice\ndoc_to_text: \"{MC_TEXT}\"\ndoc_to_choice: \"{{{{choices}}}}\"\n"
        "doc_to_target: \"{{answer}}\"\nmetric_list:\n  - metric: acc\n")
    (folder / "smartspec_names_gen.yaml").write_text(
        "task: smartspec_names_gen\n" + common.format(path=folder / "gen.jsonl") +
        "output_type: generate_until\n" + "doc_to_text: " + json.dumps(GEN_TEXT) + "\n"
        "doc_to_target: \"{{answer}}\"\ngeneration_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 16\n"
        "  do_sample: false\nmetric_list:\n  - metric: exact_match\n    aggregation: mean\n"
        "    higher_is_better: true\n    regexes_to_ignore: [\"\\\\s\", \"`\"]\n")


# what lm-eval runs against the server, per kind of check: its model type, the task, the endpoint, whether chat
LM_EVAL_RUNS = {"mc": ("local-completions", "smartspec_names_mc", "/v1/completions", False),
                "gen": ("local-chat-completions", "smartspec_names_gen", "/v1/chat/completions", True)}


def run_lm_eval(args, kind: str, tokenizer: str, tasks: Path) -> dict:
    """lm-eval's run of one check (LM_EVAL_RUNS) against the server, its outputs under args.out/<kind>: the
    logged samples and the task's results."""
    model_type, task, endpoint, chat = LM_EVAL_RUNS[kind]
    lm_eval, url, model, out = args.lm_eval, f"{args.url}{endpoint}", args.model, Path(args.out).resolve() / kind
    model_args = f"model={model},base_url={url},tokenizer={tokenizer},tokenizer_backend=huggingface," \
                 "num_concurrent=1,max_retries=1,timeout=600"
    cmd = [lm_eval, "--model", model_type, "--model_args", model_args, "--include_path", str(tasks), "--tasks", task,
           "--output_path", str(out), "--log_samples", "--batch_size", "1"]
    if chat:
        cmd.append("--apply_chat_template")
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    samples = max(out.rglob(f"samples_{task}_*.jsonl"))
    return {"samples": [json.loads(line) for line in samples.read_text().splitlines()],
            "results": json.loads(max(out.rglob("results_*.json")).read_text())["results"][task]}


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split: trailing spaces of the context go to the continuation; the whole is encoded once."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        continuation, context = context[-spaces:] + continuation, context[:-spaces]
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    ctx = tokenizer(context, add_special_tokens=False)["input_ids"]
    return ctx, whole[len(ctx):]


def choice_pairs(sample: dict) -> list[tuple[str, str]]:
    """A logged loglikelihood sample's (context, continuation) per choice."""
    args = sample["arguments"]
    if isinstance(args, dict):  # {"gen_args_0": {"arg_0": context, "arg_1": continuation}, ...}
        return [(a["arg_0"], a["arg_1"]) for a in args.values()]
    return [tuple(a) for a in args]


def command_line() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lm-eval", default=".venv-lmeval/bin/lm_eval", help="lm-eval's command (its own venv)")
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b", help="the served name, and the model scored offline")
    ap.add_argument("--docs", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/lm_eval")
    return ap


def main() -> int:
    args = command_line().parse_args()
    out = Path(args.out).resolve()
    tasks = out / "tasks"
    write_tasks(tasks, args.docs, args.seed)
    path = resolve(args.model)
    mc, gen = run_lm_eval(args, "mc", path, tasks), run_lm_eval(args, "gen", path, tasks)
    llm = LLM(args.model, kv_cache_gib=0.5, max_model_len=4096)
    mc_rows, same_values, correct = score_choices(llm, mc["samples"])
    gen_rows, gen_same, gen_correct = score_generations(llm, gen["samples"])
    n_values = sum(len(r["served"]) for r in mc_rows)  # values kept as repr: exact
    print(f"\nloglikelihood multiple choice ({len(mc['samples'])} docs): lm-eval acc {mc['results'].get('acc,none')}, "
          f"offline engine acc {correct / len(mc['samples'])}; per-choice loglikelihoods bitwise equal: "
          f"{same_values}/{n_values}")
    print(f"chat generate_until ({len(gen['samples'])} docs): lm-eval exact_match "
          f"{gen['results'].get('exact_match,none')}, offline engine {gen_correct / len(gen['samples'])}; "
          f"generations identical: {gen_same}/{len(gen['samples'])}")
    import pandas as pd

    pd.DataFrame(mc_rows + gen_rows).to_parquet(out / "check.parquet")
    print(f"wrote {out}")
    return 0 if same_values == n_values and gen_same == len(gen["samples"]) else 1


def score_choices(llm, samples: list[dict]) -> tuple[list[dict], int, int]:
    """Each multiple-choice sample's loglikelihoods scored offline (prompt logprobs of the continuation): rows,
    values bitwise equal to the served ones, and answers the offline values get right."""
    rows, same_values, correct = [], 0, 0
    for s in samples:
        values = []
        for context, continuation in choice_pairs(s):
            ctx, cont = encode_pair(llm.tokenizer, context, continuation)
            out_ = llm.generate(ctx + cont, SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
            values.append(sum(p.logprob for p in out_.prompt_logprobs[len(ctx):]))
        served = [float(r[0][0]) for r in s["resps"]]
        same_values += sum(a == b for a, b in zip(values, served))
        correct += int(max(range(len(values)), key=values.__getitem__) == int(s["doc"]["answer"]))
        rows.append({"task": "mc", "doc": s["doc_id"], "served": list(map(repr, served)),
                     "offline": list(map(repr, values))})
    return rows, same_values, correct


def score_generations(llm, samples: list[dict]) -> tuple[list[dict], int, int]:
    """Each chat sample generated offline: rows, generations identical to the served ones, and exact matches."""
    rows, same, correct = [], 0, 0
    for s in samples:
        messages = [{"role": "user", "content": GEN_TEXT.replace("{{code}}", s["doc"]["code"])}]
        prompt = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        text = llm.generate(prompt, SamplingParams(max_tokens=16, stop=["\n"]))[0].text
        served = s["resps"][0][0]
        same += int(text == served)
        correct += int(text.strip() == s["target"].strip())
        rows.append({"task": "gen", "doc": s["doc_id"], "served": [served], "offline": [text]})
    return rows, same, correct


if __name__ == "__main__":
    sys.exit(main())
