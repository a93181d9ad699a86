"""What agents and apps send, checked with the `openai` SDK against a running server (`serve run config.yaml`):
structured outputs on 20 prompts and schemas (each answer parsed and validated with jsonschema), JSON mode, a
regex and a choice; a tool-calling round trip (auto, required and a named function, unary and streamed); the
sampling controls. Every greedy answer is compared with the same request sent with speculation off for it
(`"speculation": {"max_k": 0}`), on the same server.

    serve run config.yaml &                       # the default pair, draft-model speculation on
    python scripts/check_openai_features.py       # ~5 min on 2 cores; writes results/openai_features.json

Its figures: docs/serving.md, "Endpoints"."""
from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import jsonschema
from openai import OpenAI

S, I, B = {"type": "string"}, {"type": "integer"}, {"type": "boolean"}


def obj(**props) -> dict:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


CASES = [  # (prompt, schema): twenty extraction and generation tasks
    ("Who wrote Hamlet, and in roughly which year?", obj(author=S, year=I)),
    ("Name a prime number below 20 and say whether it is even.", obj(prime=I, is_even=B)),
    ("Give the capital and the population (in millions, rounded) of Japan.", obj(capital=S, population_millions=I)),
    ("List three Python web frameworks.", obj(frameworks={"type": "array", "items": S, "minItems": 3,
                                                          "maxItems": 3})),
    ("Describe a book: title, author, and page count.", obj(title=S, author=S, pages=I)),
    ("Classify the sentiment of: 'I love this phone, the battery lasts forever!'",
     obj(sentiment={"enum": ["positive", "negative", "neutral"]}, confidence={"type": "number"})),
    ("Extract the meeting: 'Sync with Dana on Tuesday at 3pm in room 4B about the budget.'",
     obj(person=S, day=S, time=S, room=S, topic=S)),
    ("Convert 3 feet to inches and show the formula.", obj(inches=I, formula=S)),
    ("Give an HTTP status code for 'not found' and its reason phrase.", obj(code=I, reason=S)),
    ("Describe a 2D point in the first quadrant.", obj(point=obj(x=I, y=I))),
    ("Make a todo list with two items, each with a priority from 1 to 3.",
     obj(items={"type": "array", "items": obj(task=S, priority={"type": "integer", "minimum": 1, "maximum": 3}),
                "minItems": 2, "maxItems": 2})),
    ("Is 'racecar' a palindrome? Answer with the word and a boolean.", obj(word=S, palindrome=B)),
    ("Give the chemical symbol and atomic number of iron.", obj(symbol=S, atomic_number=I)),
    ("Summarise: 'The server restarted at 02:00 after a kernel update; no data was lost.'",
     obj(event=S, time=S, data_lost=B)),
    ("Write a function signature in Python for adding two integers.", obj(name=S, parameters={
        "type": "array", "items": S}, returns=S)),
    ("Pick a color of the rainbow and give its hex code.", obj(color=S, hex={"type": "string",
                                                                            "pattern": "^#[0-9a-fA-F]{6}$"})),
    ("Report the weather: sunny, 24 degrees Celsius, light wind.",
     obj(condition={"enum": ["sunny", "cloudy", "rainy", "snowy"]}, temperature_c=I, wind=S)),
    ("Give a user record with a username, an age and whether the account is active.",
     obj(username=S, age={"type": "integer", "minimum": 0, "maximum": 130}, active=B)),
    ("Name a programming language and the year it first appeared.", obj(language=S, year=I)),
    ("Give an optional middle name for 'John Smith' (null if none).",
     obj(first=S, middle={"anyOf": [S, {"type": "null"}]}, last=S)),
]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
           "parameters": obj(city=S)}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The local time in a time zone",
        "parameters": obj(timezone=S)}}


def arguments() -> argparse.ArgumentParser:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--out", default="results/openai_features.json")
    return ap


class Checker:
    """Asks the server, with and without speculation, and records each check's row."""

    def __init__(self, url: str, model: str) -> None:
        self.client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=600, max_retries=0)
        self.model = model
        self.rows: list[dict] = []

    def ask(self, messages, no_spec=False, **kw):
        extra = {**kw.pop("extra_body", {}), **({"speculation": {"max_k": 0}} if no_spec else {})}
        t0 = time.perf_counter()
        r = self.client.chat.completions.create(model=self.model, messages=messages, temperature=0,
                                                extra_body=extra, **kw)
        return r, time.perf_counter() - t0

    def record(self, check, ok, equal, detail="", seconds=0.0) -> None:
        self.rows.append({"check": check, "ok": bool(ok), "equal_without_speculation": equal, "detail": detail,
                          "seconds": round(seconds, 2)})
        print(f"{'ok ' if ok else 'BAD'} {'=' if equal else ('≠' if equal is False else ' ')} {check:44s} "
              f"{seconds:6.1f} s  {detail[:70]}", flush=True)


def check_schemas(c: Checker) -> None:
    """Each JSON schema case: valid against its schema, and equal to the answer without speculation."""
    for i, (prompt, schema) in enumerate(CASES):
        fmt = {"type": "json_schema", "json_schema": {"name": f"case{i}", "schema": schema}}
        messages = [{"role": "user", "content": prompt + " Answer in JSON."}]
        r, s = c.ask(messages, response_format=fmt, max_tokens=200)
        plain, _ = c.ask(messages, no_spec=True, response_format=fmt, max_tokens=200)
        text = r.choices[0].message.content
        try:
            jsonschema.validate(json.loads(text), schema)
            ok = True
        except (ValueError, jsonschema.ValidationError):
            ok = False
        c.record(f"json_schema {i:2d}", ok, text == plain.choices[0].message.content, text, s)


def check_controls(c: Checker) -> None:
    """json_object, a regex, a choice, and the sampling controls together."""
    for check, prompt, kw, valid in [
        ("json_object", "Describe the planet Mars in JSON, in three short fields.",
         {"response_format": {"type": "json_object"}},
         lambda t: isinstance(json.loads(t), dict)),
        ("regex (an email)", "Write a support email address for a company called Acme.",
         {"extra_body": {"structured_outputs": {"regex": r"[a-z]{1,20}@[a-z]{1,20}\.(com|org)"}}},
         lambda t: re.fullmatch(r"[a-z]{1,20}@[a-z]{1,20}\.(com|org)", t)),
        ("choice", "The sentiment of 'great service, thank you!' is", {"extra_body": {"structured_outputs": {
            "choice": ["positive", "negative", "neutral"]}}}, lambda t: t == "positive"),
        ("penalties, logit_bias, min_p, min_tokens", "Write a haiku about the sea.", {
            "presence_penalty": 0.5, "frequency_penalty": 0.5, "logit_bias": {"198": -5},
            "extra_body": {"repetition_penalty": 1.1, "min_p": 0.05, "min_tokens": 20}}, lambda t: len(t) > 0),
    ]:
        messages = [{"role": "user", "content": prompt}]
        r, s = c.ask(messages, max_tokens=160, **dict(kw))
        plain, _ = c.ask(messages, no_spec=True, max_tokens=160, **dict(kw))
        text = r.choices[0].message.content
        try:
            ok = bool(valid(text))
        except ValueError:
            ok = False
        c.record(check, ok, text == plain.choices[0].message.content, text, s)


def tool_answer(resp):
    msg = resp.choices[0].message
    return [call.function.model_dump() for call in msg.tool_calls or []] or msg.content


def check_tool_calls(c: Checker, messages: list[dict]) -> None:
    """tool_choice auto, required and named; and tool calls streamed."""
    for choice in ("auto", "required", {"type": "function", "function": {"name": "get_weather"}}):
        r, s = c.ask(messages, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=128)
        plain, _ = c.ask(messages, no_spec=True, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=128)
        calls = r.choices[0].message.tool_calls or []
        ok = r.choices[0].finish_reason == "tool_calls" and calls and calls[0].function.name == "get_weather" \
            and json.loads(calls[0].function.arguments).get("city")
        if choice == "auto":  # the model's own choice: answered either way, and the detail says which
            ok = r.choices[0].finish_reason in ("stop", "tool_calls")
        c.record(f"tool_choice {choice if isinstance(choice, str) else 'named'}", ok,
                 tool_answer(r) == tool_answer(plain), json.dumps(tool_answer(r)), s)
    stream = c.client.chat.completions.create(model=c.model, messages=messages, tools=[WEATHER, TIME],
                                              tool_choice="required", temperature=0, max_tokens=128, stream=True)
    deltas = [d for chunk in stream if chunk.choices for d in (chunk.choices[0].delta.tool_calls or [])]
    c.record("tool_calls streamed", deltas and deltas[0].function.name == "get_weather", None,
             json.dumps([d.function.model_dump() for d in deltas]))


def check_tool_results(c: Checker, messages: list[dict]) -> None:
    """A call's result sent back: answered with tool_choice none, the model's choice with auto."""
    first, _ = c.ask(messages, tools=[WEATHER, TIME], tool_choice="required", max_tokens=128)
    follow = messages + [first.choices[0].message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}
        for call in first.choices[0].message.tool_calls]
    for choice in ("none", "auto"):  # auto: the model's choice (answer, or call again); the detail says which
        r, s = c.ask(follow, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=64)
        answer = r.choices[0].message.content or ""
        ok = "18" in answer if choice == "none" else r.choices[0].finish_reason in ("stop", "tool_calls")
        c.record(f"tool result -> answer ({choice})", ok and r.choices[0].finish_reason != "length", None,
                 answer or json.dumps([call.function.model_dump() for call in r.choices[0].message.tool_calls or []]),
                 s)


def main() -> None:
    args = arguments().parse_args()
    c = Checker(args.url, args.model)
    check_schemas(c)
    check_controls(c)
    weather = [{"role": "user", "content": "What is the weather in Paris right now?"}]  # question -> call -> answer
    check_tool_calls(c, weather)
    check_tool_results(c, weather)
    rows = c.rows
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "model": args.model, "rows": rows},
                                         indent=1))
    js = [r for r in rows if r["check"].startswith("json_schema")]
    print(f"\njson_schema: {sum(r['ok'] for r in js)}/{len(js)} valid, "
          f"{sum(bool(r['equal_without_speculation']) for r in js)}/{len(js)} equal without speculation; "
          f"all checks ok: {sum(r['ok'] for r in rows)}/{len(rows)}")


if __name__ == "__main__":
    main()
