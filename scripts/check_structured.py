"""Structured-output quality on a real model: 50 extraction and description prompts whose schemas have arrays,
enums and nesting, each answered three ways, greedy:

- free: the prompt alone (it asks for the JSON), the answer's first JSON value read out of the text;
- one JSON layout per --layouts: the same prompt constrained to the schema, the grammar's whitespace as named
  (`compact`: one line, separators fixed; `flexible`: the whitespace a model writes, bounded as the server's is).

Checks every constrained answer is valid for its schema and ended on its own (a loop runs to max_tokens), and
counts how often its values agree with the free answer's (the scalars both have, compared as text). Prints a
table (its `free` row: free answers that hold a JSON object, and those that ran to max_tokens); writes
results/structured_quality/answers.json (every answer) and quality.png.

    python scripts/check_structured.py                      # the default target, ~12 min on 2 cores
    python scripts/check_structured.py --limit 8            # the first 8 prompts

Its figures: docs/benchmarks.md, "Structured and predicted outputs"."""
from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

from smartspec import LLM, SamplingParams
from smartspec.structured.compile import json_layout
from smartspec.types.sampling_params import StructuredOutput


def obj(required: dict, optional: dict | None = None) -> dict:
    props = {**required, **(optional or {})}
    return {"type": "object", "properties": props, "required": list(required), "additionalProperties": False}


S, I, N, B = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}
STRINGS = {"type": "array", "items": S}


def enum(*values: str) -> dict:
    return {"type": "string", "enum": list(values)}


PERSON = obj({"name": S, "age": I, "city": S, "hobbies": STRINGS})
ORDER = obj({"customer": S, "email": S, "items": {"type": "array", "items": obj({"product": S, "quantity": I})},
             "express": B})
EVENT = obj({"title": S, "date": S, "location": obj({"city": S, "venue": S}), "speakers": STRINGS})
REVIEW = obj({"product": S, "sentiment": enum("positive", "neutral", "negative"), "rating": I, "pros": STRINGS,
              "cons": STRINGS})
TICKET = obj({"summary": S, "priority": enum("low", "medium", "high", "urgent"),
              "category": enum("billing", "bug", "account", "feature_request", "other"), "steps": STRINGS})
RECIPE = obj({"name": S, "servings": I, "ingredients": {"type": "array", "items": obj({"item": S, "amount": S})},
              "steps": STRINGS})
LANGUAGE = obj({"name": S, "year": I, "paradigms": STRINGS, "typing": enum("static", "dynamic", "gradual")})
COUNTRY = obj({"name": S, "capital": S, "continent": enum("Africa", "Asia", "Europe", "North America",
                                                          "South America", "Oceania"),
               "languages": STRINGS, "neighbours": STRINGS})
PLANET = obj({"name": S, "order_from_sun": I, "moons": I, "type": enum("rocky", "gas giant", "ice giant"),
              "notable_features": STRINGS})
BOOK = obj({"title": S, "author": S, "year": I, "genre": enum("fiction", "non-fiction", "poetry", "drama"),
            "main_characters": STRINGS})
ELEMENT = obj({"name": S, "symbol": S, "atomic_number": I, "group": enum("metal", "nonmetal", "metalloid",
                                                                           "noble gas"), "uses": STRINGS})
ANIMAL = obj({"name": S, "class": enum("mammal", "bird", "reptile", "amphibian", "fish", "insect"),
              "diet": enum("herbivore", "carnivore", "omnivore"), "habitats": STRINGS})

EXTRACT = [  # (text, schema): extract what the text says
    ("Hi, I'm Laura Chen, 34, from Seattle. I love hiking, pottery and chess.", PERSON),
    ("Marco Rossi is 52 and lives in Turin; on weekends he cycles and cooks.", PERSON),
    ("Name: Amara Okafor. Age: 27. City: Lagos. Hobbies: painting, football.", PERSON),
    ("This is Jonas (41) writing from Oslo. I collect stamps and play the violin and go skiing.", PERSON),
    ("Order from Priya Natarajan (priya.n@corp.in): 2 keyboards and 1 monitor, express shipping please.", ORDER),
    ("Tom Becker, tom.b@mailbox.org, wants 3 notebooks, 10 pens and a stapler. Standard delivery is fine.", ORDER),
    ("Please send 1 laptop stand to Aiko Tanaka <aiko@tanaka.jp> - express.", ORDER),
    ("Sam O'Neil (sam@oneil.ca) ordered 4 coffee mugs and 2 teapots; no rush.", ORDER),
    ("PyCon Nordic takes place on 12 May 2027 at the Tivoli Congress Center in Copenhagen, with talks by Ana "
     "Ruiz and Lee Park.", EVENT),
    ("Join us for the Rust Meetup, 3 February 2027, at the Kulturbrauerei, Berlin. Speakers: Jan Kowalski, "
     "Mia Wong, Omar Haddad.", EVENT),
    ("The Data Summit will be held at Moscone Center, San Francisco on October 8, 2027. Keynote by Grace Liu.",
     EVENT),
    ("I bought the AeroPress Go. Great coffee and very portable, but the cap is fiddly. 4 out of 5.", REVIEW),
    ("The QuietMax headphones broke after a week and the support was rude. 1/5, avoid.", REVIEW),
    ("Kindle Paperwhite: fine screen, long battery. Nothing special otherwise. Three stars.", REVIEW),
    ("Solid desk lamp (BrightArm). Bright, stable, cheap. The switch is a bit loud. I'd give it 5.", REVIEW),
    ("I was charged twice for my March invoice, please refund one of the charges as soon as possible!", TICKET),
    ("The export button crashes the app when I click it after opening a PDF. Happens every time, please fix "
     "today, our demo is tomorrow.", TICKET),
    ("Could you add a dark mode? It would be nice to have at some point.", TICKET),
    ("I can't log in since I changed my password; the reset email never arrives.", TICKET),
    ("Pancakes for 4: 200 g flour, 2 eggs, 300 ml milk, a pinch of salt. Whisk everything, rest 10 minutes, "
     "fry in a hot pan.", RECIPE),
    ("Guacamole (serves 2): 2 avocados, 1 lime, half an onion, salt. Mash the avocados, add lime juice, chopped "
     "onion and salt.", RECIPE),
    ("Tomato soup for 6: 1 kg tomatoes, 1 onion, 2 cloves garlic, 1 litre stock. Roast the tomatoes, fry the "
     "onion and garlic, simmer with stock, blend.", RECIPE),
    ("Hello, Fatima Zahra here, 19 years old, Casablanca. I like reading, swimming and coding.", PERSON),
    ("Order for Lukas Novak, lukas.novak@seznam.cz: 12 bottles of water. Express.", ORDER),
    ("The Vue.js Conference, Amsterdam, at the Theater Amsterdam, on 20 June 2027; speakers Evan You and "
     "Sarah Drasner.", EVENT),
]
DESCRIBE = [  # (subject, schema): what the model knows
    ("the Python programming language", LANGUAGE), ("the Rust programming language", LANGUAGE),
    ("the Go programming language", LANGUAGE), ("TypeScript", LANGUAGE), ("Haskell", LANGUAGE),
    ("Java", LANGUAGE), ("France", COUNTRY), ("Japan", COUNTRY), ("Brazil", COUNTRY), ("Kenya", COUNTRY),
    ("Canada", COUNTRY), ("Mars", PLANET), ("Jupiter", PLANET), ("Neptune", PLANET), ("Earth", PLANET),
    ("the novel Pride and Prejudice", BOOK), ("the novel 1984", BOOK), ("Hamlet", BOOK),
    ("the element oxygen", ELEMENT), ("the element iron", ELEMENT), ("the element helium", ELEMENT),
    ("the lion", ANIMAL), ("the penguin", ANIMAL), ("the frog", ANIMAL), ("the honey bee", ANIMAL),
]
LAYOUTS = ("compact", "flexible")


def prompts() -> list[tuple[str, str, dict]]:
    """(id, instruction, schema) for every prompt: the instruction asks for the JSON and names its keys, as an
    application's prompt does."""
    out = []
    for i, (text, schema) in enumerate(EXTRACT):
        out.append((f"extract-{i:02d}", f"Extract the information from this text as JSON with the keys "
                                        f"{', '.join(schema['properties'])}.\n\n{text}", schema))
    for i, (subject, schema) in enumerate(DESCRIBE):
        out.append((f"describe-{i:02d}", f"Describe {subject} as JSON with the keys "
                                         f"{', '.join(schema['properties'])}.", schema))
    return out


def first_json(text: str):
    """The first JSON object in a free answer (inside a code fence or not); None if there is none."""
    decoder = json.JSONDecoder()
    for i, ch in enumerate(text):
        if ch == "{":
            try:
                return decoder.raw_decode(text[i:])[0]
            except ValueError:
                continue
    return None


def scalars(value, path: str = "") -> dict[str, str]:
    """path -> scalar as lower-case text, for every scalar leaf of a JSON value (array items by position)."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in scalars(item, f"{path}/{key}").items()}
    if isinstance(value, list):
        return {k: v for i, item in enumerate(value) for k, v in scalars(item, f"{path}/{i}").items()}
    return {path: str(value).strip().lower()}


def valid(value, schema: dict) -> bool:
    """value satisfies schema (the subset the prompts use: objects, arrays, enums, scalar types)."""
    kind = schema.get("type")
    if "enum" in schema:
        return value in schema["enum"]
    if kind == "object":
        return (isinstance(value, dict) and set(schema["required"]) <= set(value) <= set(schema["properties"])
                and all(valid(value[k], schema["properties"][k]) for k in value))
    if kind == "array":
        return isinstance(value, list) and all(valid(v, schema["items"]) for v in value)
    types = {"string": str, "integer": int, "number": (int, float), "boolean": bool}[kind]
    return isinstance(value, types) and (kind == "boolean" or not isinstance(value, bool))


def grade(text: str, finish: str, schema: dict, free) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    row = {"valid": value is not None and valid(value, schema), "loop": finish == "length"}
    if value is not None and isinstance(free, dict):
        ours, theirs = scalars(value), scalars(free)
        shared = sorted(set(ours) & set(theirs))
        row.update(compared=len(shared), agreed=sum(ours[k] == theirs[k] for k in shared))
    return row


def run(args) -> list[dict]:
    llm = LLM(args.model, speculative_config=None, max_num_seqs=args.batch)
    tok = llm.tokenizer
    items = prompts()[:args.limit]
    chats = [tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                     add_generation_prompt=True) for _, text, _ in items]
    print(f"free answers for {len(items)} prompts", flush=True)
    free = llm.generate(chats, SamplingParams(max_tokens=args.max_tokens), progress=True)
    rows = [{"id": pid, "prompt": text, "free": f.text, "free_finish": f.finish_reason}
            for (pid, text, _), f in zip(items, free)]
    for layout in args.layouts:
        print(f"constrained, {layout} layout", flush=True)
        params = [SamplingParams(max_tokens=args.max_tokens,
                                 structured=StructuredOutput(json={**schema, "x-guidance": json_layout(layout)}))
                  for _, _, schema in items]
        for row, (_, _, schema), out in zip(rows, items, llm.generate(chats, params, progress=True)):
            row[layout] = {"text": out.text, "finish": out.finish_reason, "tokens": len(out.token_ids),
                           **grade(out.text, out.finish_reason, schema, first_json(row["free"]))}
    return rows


def summary(rows: list[dict], layouts: list[str]) -> list[dict]:
    free = [first_json(r["free"]) for r in rows]
    out = [{"layout": "free", "prompts": len(rows), "valid": sum(isinstance(f, dict) for f in free),
            "loops": sum(r["free_finish"] == "length" for r in rows), "mean_tokens": None, "values_compared": 0,
            "values_agreed": 0}]
    for layout in layouts:
        graded = [r[layout] for r in rows]
        compared = sum(g.get("compared", 0) for g in graded)
        out.append({"layout": layout, "prompts": len(graded), "valid": sum(g["valid"] for g in graded),
                    "loops": sum(g["loop"] for g in graded), "mean_tokens": sum(g["tokens"] for g in graded)
                    / max(len(graded), 1), "values_compared": compared,
                    "values_agreed": sum(g.get("agreed", 0) for g in graded)})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--limit", type=int, default=None, help="the first N prompts only")
    ap.add_argument("--out", default="results/structured_quality")
    args = ap.parse_args()
    rows = run(args)
    table = summary(rows, args.layouts)
    print(f"\n{'layout':<10}{'prompts':>8}{'valid':>7}{'loops':>7}{'tokens':>8}{'agree':>14}")
    for t in table:
        agree = f"{t['values_agreed']}/{t['values_compared']}"
        tokens = "" if t["mean_tokens"] is None else f"{t['mean_tokens']:.1f}"
        agree = agree if t["values_compared"] else ""
        print(f"{t['layout']:<10}{t['prompts']:>8}{t['valid']:>7}{t['loops']:>7}{tokens:>8}{agree:>14}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "answers.json").write_text(json.dumps({"model": args.model, "cpu": platform.processor(),
                                                  "summary": table, "rows": rows}, indent=1))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 3.5))
        names = ["valid", "ended", "values agree"]
        for i, t in enumerate(table[1:]):
            shares = [t["valid"] / t["prompts"], 1 - t["loops"] / t["prompts"],
                      t["values_agreed"] / max(t["values_compared"], 1)]
            ax.bar([x + 0.4 * i for x in range(3)], shares, width=0.4, label=t["layout"])
        ax.set_xticks([x + 0.2 for x in range(3)], names)
        ax.set_ylabel("share of prompts (values: of compared)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "quality.png", dpi=120)
    except ModuleNotFoundError:
        print("no plot: matplotlib is not installed (pip install -e '.[bench]')")
    print(f"wrote {out / 'answers.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
