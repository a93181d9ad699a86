"""Property-based requests against a running SmartSpec server: nothing a client sends gets a 5xx or hangs, and the
server is healthy with every KV block free afterwards.

Requests are drawn by hypothesis: both endpoints (and the Serve handle, when this process holds one), every field
of the API (`response_format`, `tools`, `tool_choice`, `logit_bias`, `prediction`, `structured_outputs`,
`speculation`, `stop`, `n`, `logprobs`, sampling controls, streams with hang-ups), valid values beside wrong types,
out-of-range numbers, odd unicode, huge and deeply nested values. Per request: its status (a 5xx, or an error event
of a 5xx inside a stream, is a failure), whether a 4xx names what is wrong, and whether it ended within --timeout
seconds (a hang otherwise). Writes results/fuzz_api.jsonl (one line per request: endpoint, status, seconds, and
the body of any failure) and prints, last, `requests N; 5xx F; hangs H; kv back yes|no`.

    serve run config-light.yaml &            # or any served config
    python scripts/fuzz_api.py --requests 2000 [--url http://127.0.0.1:8000] [--model smollm2-135m]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

ODD_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=40)
TEXT = st.one_of(st.sampled_from(["hello", "def f(x):", "Name three colours.", "", " ", "\n\n", "{\"a\": 1}"]),
                 ODD_TEXT, st.text(min_size=2000, max_size=6000, alphabet="ab \n"))
# floats include NaN and infinities: JSON has no such numbers, but Python's json module (the server's) reads the
# NaN and Infinity literals that json.dumps writes
JUNK = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | ODD_TEXT,
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(ODD_TEXT, inner, max_size=4),
                    max_leaves=12)
DEEP = st.integers(1, 300).map(lambda d: json.loads("[" * d + "]" * d))  # deeply nested, past any sane limit


@st.composite
def maybe(draw, valid: st.SearchStrategy):
    """Mostly a value the API could take; one time in ten anything at all."""
    return draw(JUNK) if draw(st.integers(0, 9)) == 0 else draw(valid)


def schemas(depth: int = 2) -> st.SearchStrategy:
    leaves = st.one_of(
        st.sampled_from([{"type": t} for t in ("string", "integer", "number", "boolean", "null")]),
        st.lists(st.text(max_size=6), min_size=1, max_size=4).map(lambda v: {"enum": v}),
        st.builds(lambda lo, hi: {"type": "integer", "minimum": lo, "maximum": hi}, st.integers(-5, 5),
                  st.integers(-5, 5)),
        st.sampled_from([{}, {"type": "nonsense"}, {"$ref": "#/nowhere"}, {"pattern": "("}, {"type": []}]))
    if depth == 0:
        return leaves
    inner = schemas(depth - 1)
    objects = st.builds(lambda props, strict: {"type": "object", "properties": props, "required": list(props)[:1],
                                               **({"additionalProperties": False} if strict else {})},
                        st.dictionaries(st.from_regex(r"[a-z]{1,8}", fullmatch=True), inner, max_size=3),
                        st.booleans())
    arrays = st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, inner, st.integers(0, 4))
    return st.one_of(leaves, objects, arrays)


TOOL = st.builds(lambda name, params: {"type": "function", "function": {"name": name, "parameters": params}},
                 st.one_of(st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,12}", fullmatch=True), ODD_TEXT), schemas(1))
STRUCTURED = st.one_of(
    st.builds(lambda s: {"json": s}, schemas()), st.just({"json_object": True}),
    st.builds(lambda r: {"regex": r}, st.one_of(st.sampled_from([r"\d{1,3}", r"(yes|no)", "[a-z]+", "(", "a{99999}"]),
                                               ODD_TEXT)),
    st.builds(lambda c: {"choice": c}, st.lists(ODD_TEXT, max_size=4)),
    st.builds(lambda g: {"grammar": g}, st.one_of(st.just('start: "yes" | "no"'), st.just("root ::= [0-9]+"),
                                                 ODD_TEXT)),
    st.builds(lambda a, b: {"regex": a, "choice": b}, ODD_TEXT, st.lists(ODD_TEXT, max_size=2)))
RESPONSE_FORMAT = st.one_of(
    st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "json_schema"}, {"type": "xml"}]),
    st.builds(lambda name, s, strict: {"type": "json_schema", "json_schema": {"name": name, "schema": s,
                                                                              "strict": strict}},
              st.one_of(st.just("answer"), ODD_TEXT), schemas(), st.one_of(st.none(), st.booleans())))
@st.composite
def mostly(draw, valid: st.SearchStrategy, odd: st.SearchStrategy):
    """valid four times in five, else odd (out of range, or a value the API refuses)."""
    return draw(odd) if draw(st.integers(0, 4)) == 0 else draw(valid)


NUMBERS = {
    "temperature": mostly(st.one_of(st.just(0), st.floats(0, 2)),
                          st.one_of(st.floats(-10, 10), st.sampled_from([1e308, float("nan"), float("inf")]))),
    "top_p": mostly(st.floats(0.01, 1), st.one_of(st.floats(-1, 2), st.just(float("nan")))),
    "top_k": mostly(st.integers(0, 100), st.integers(-5, 0)),
    "min_p": mostly(st.floats(0, 1), st.floats(-1, 2)),
    "seed": mostly(st.integers(0, 2**32), st.integers(-2**70, 2**70)),
    "presence_penalty": mostly(st.floats(-2, 2), st.floats(-9, 9)),
    "frequency_penalty": mostly(st.floats(-2, 2), st.floats(-9, 9)),
    "repetition_penalty": mostly(st.floats(0.5, 2), st.floats(-1, 3)),
    "min_tokens": mostly(st.integers(0, 6), st.integers(-2, 12)),
}


def common_fields() -> dict:
    return {
        "max_tokens": mostly(st.integers(1, 8), st.one_of(st.integers(-3, 0), st.just(10**9))),
        "n": mostly(st.integers(1, 3), st.sampled_from([0, 9, 10**6])),
        "stop": st.one_of(st.none(), ODD_TEXT, st.lists(ODD_TEXT, max_size=5)),
        "logit_bias": st.dictionaries(st.one_of(st.integers(-5, 200_000).map(str), ODD_TEXT),
                                      st.one_of(st.floats(-100, 100), st.floats(-1e6, 1e6)), max_size=4),
        "stream": st.booleans(),
        "stream_options": st.one_of(st.none(), st.just({"include_usage": True})),
        "structured_outputs": STRUCTURED,
        "response_format": RESPONSE_FORMAT,
        "prediction": st.builds(lambda c: {"type": "content", "content": c}, TEXT),
        "speculation": st.builds(lambda k: {"max_k": k}, mostly(st.integers(0, 8), st.integers(-2, 40))),
        "ignore_eos": st.booleans(),
        **NUMBERS,
    }


MESSAGE = st.builds(lambda role, content: {"role": role, "content": content},
                    st.sampled_from(["user", "user", "user", "system", "assistant", "developer", "tool", "robot"]),
                    maybe(st.one_of(TEXT, st.just([{"type": "text", "text": "hi"}]))))


@st.composite
def requests(draw, model: str) -> tuple[str, dict, bool]:
    """(endpoint, body, hang up early): a random subset of the fields, each drawn as maybe()."""
    chat = draw(st.booleans())
    body = {"model": draw(maybe(st.just(model)))}
    if chat:
        body["messages"] = draw(maybe(st.lists(MESSAGE, min_size=1, max_size=4)))
        extra = {"logprobs": st.booleans(), "top_logprobs": mostly(st.integers(0, 5), st.integers(-1, 25)),
                 "tools": st.lists(TOOL, max_size=3),
                 "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required", "sometimes"]),
                                          st.builds(lambda n: {"type": "function", "function": {"name": n}},
                                                    ODD_TEXT)),
                 "parallel_tool_calls": st.booleans(),
                 "max_completion_tokens": mostly(st.integers(1, 8), st.integers(-1, 0))}
    else:
        body["prompt"] = draw(maybe(st.one_of(TEXT, st.lists(st.integers(-5, 200_000), max_size=8),
                                              st.lists(TEXT, min_size=1, max_size=3))))
        extra = {"logprobs": mostly(st.integers(0, 5), st.integers(-1, 25)), "echo": st.booleans()}
    fields = {**common_fields(), **extra}
    if draw(st.integers(0, 49)):  # without it, a chat runs to the context's end: one request in fifty
        body["max_tokens"] = draw(fields["max_tokens"])
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=4, unique=True)):
        body[name] = draw(maybe(fields[name]))
    if draw(st.integers(0, 30)) == 0:
        body[draw(st.sampled_from(sorted(fields)))] = draw(DEEP)
    if draw(st.integers(0, 30)) == 0:
        body[draw(ODD_TEXT)] = draw(JUNK)  # a field the API does not have
    return ("/v1/chat/completions" if chat else "/v1/completions"), body, draw(st.integers(0, 9)) == 0


@dataclass
class Tally:
    requests: int = 0
    by_status: dict[str, int] = field(default_factory=dict)
    server_errors: int = 0  # 5xx, or a 5xx error event inside a stream
    unnamed: int = 0  # a 4xx without an error message
    hangs: int = 0
    failures: list[dict] = field(default_factory=list)

    def add(self, endpoint: str, body, status, seconds: float, problem: str | None) -> dict:
        """One request's row (with its body where it failed)."""
        self.requests += 1
        self.by_status[str(status)] = self.by_status.get(str(status), 0) + 1
        row = {"endpoint": endpoint, "status": status, "seconds": round(seconds, 3)}
        if problem is not None:
            row.update(problem=problem, body=body)
            self.failures.append(row)
        return row


def send(client: httpx.Client, url: str, endpoint: str, body: dict, hang_up: bool, key: str | None):
    """(status, problem or None): one request over HTTP, a stream read to its end (or hung up on early)."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    text = json.dumps(body)  # NaN and Infinity as Python writes them
    if body.get("stream") is not True:
        r = client.post(url + endpoint, content=text, headers=headers)
        return r.status_code, _problem(r.status_code, _json(r.text))
    with client.stream("POST", url + endpoint, content=text, headers=headers) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, _problem(r.status_code, _json(r.text))
        for i, line in enumerate(r.iter_lines()):
            if hang_up and i >= 2:
                return "hung-up", None  # the client goes away mid-stream: its request must be aborted
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = _json(line[6:])
            if event is None:
                return 200, f"a stream event is not JSON: {line[:200]!r}"
            if "error" in event and event["error"].get("code", 500) >= 500:
                return event["error"].get("code", 500), f"error event: {event['error'].get('message')!r}"
    return 200, None


def _json(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _problem(status: int, answer) -> str | None:
    if status >= 500:
        return f"{status}: {answer!r}"[:2000]
    if 400 <= status < 500 and not (isinstance(answer, dict) and (answer.get("error") or {}).get("message")):
        return f"{status} without an error message: {answer!r}"[:2000]
    if status == 200 and not isinstance(answer, dict):
        return "a 200 whose body is not a JSON object"
    return None


def call_handle(handle, endpoint: str, body: dict):
    """The same request through the Serve handle (OpenAIIngress.create): an answer, or an error dict."""
    answer = handle.create.remote({k: v for k, v in body.items() if k != "stream"},
                                  chat=endpoint.endswith("chat/completions")).result(timeout_s=120)
    status = (answer.get("error") or {}).get("code", 200) if isinstance(answer, dict) else 500
    return status, _problem(status, answer)


def kv_back(url: str, key: str | None, timeout: float = 60) -> bool:
    """Every replica's KV blocks free and nothing in flight (the status view), within timeout."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        replicas = httpx.get(f"{url}/v1/smartspec/status", headers=headers, timeout=30).json()["replicas"].values()
        if replicas and all(r["free_blocks"] == r["total_blocks"] and r["in_flight"] == 0 for r in replicas):
            return True
        time.sleep(1)
    return False


def fuzz(url: str, model: str, num_requests: int, timeout: float = 120, handle=None, key: str | None = None,
         out: Path | None = None, seed: int = 0, progress: bool = True) -> tuple[Tally, bool]:
    """Send num_requests drawn requests (every fourth through the handle, when given); the tally and whether the
    server is healthy with its KV blocks free afterwards."""
    tally, rows = Tally(), []
    client = httpx.Client(timeout=timeout)

    @hypothesis_seed(seed)
    @settings(max_examples=num_requests, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(requests(model))
    def one(drawn):
        endpoint, body, hang_up = drawn
        start = time.monotonic()
        try:
            if handle is not None and tally.requests % 4 == 3:
                status, problem = call_handle(handle, endpoint, body)
            else:
                status, problem = send(client, url, endpoint, body, hang_up, key)
        except (httpx.TimeoutException, TimeoutError) as exc:
            status, problem = "hang", f"no answer in {timeout:g} s ({exc!r})"
            tally.hangs += 1
        except httpx.HTTPError as exc:
            status, problem = "transport", repr(exc)
        except Exception as exc:  # the handle's call failed: the server did not answer it
            status, problem = 500, repr(exc)[:2000]
        if isinstance(status, int) and status >= 500:
            tally.server_errors += 1
        elif problem is not None and status not in ("hang",):
            tally.unnamed += status != "transport"
            tally.server_errors += status == "transport"  # the connection broke: the server failed it
        rows.append(tally.add(endpoint, body, status, time.monotonic() - start, problem))
        if progress and tally.requests % 100 == 0:
            print(f"  {tally.requests} requests; 5xx {tally.server_errors}; hangs {tally.hangs}; "
                  f"statuses {dict(sorted(tally.by_status.items()))}", file=sys.stderr, flush=True)

    one()
    client.close()
    healthy = httpx.get(f"{url}/health", timeout=30).status_code == 200
    back = healthy and kv_back(url, key)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("".join(json.dumps(r, default=repr) + "\n" for r in rows))
    return tally, back


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="the served model name (default: the server's /v1/models)")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--timeout", type=float, default=120, help="seconds after which a request counts as hung")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/fuzz_api.jsonl")
    args = ap.parse_args()
    if args.requests < 1:
        ap.error("--requests must be at least 1")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        model = args.model or httpx.get(f"{args.url}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, ValueError) as exc:
        sys.exit(f"no SmartSpec server answers at {args.url} ({exc!r}); start one, e.g. `serve run config-light.yaml`")
    print(f"fuzzing {args.url} ({model}) with {args.requests} requests", file=sys.stderr)
    tally, back = fuzz(args.url, model, args.requests, args.timeout, key=args.api_key, out=Path(args.out),
                       seed=args.seed)
    for failure in tally.failures[:20]:
        print(json.dumps(failure, default=repr)[:600])
    print(f"statuses {dict(sorted(tally.by_status.items()))}; 4xx without a message {tally.unnamed}; "
          f"raw rows: {args.out}")
    print(f"requests {tally.requests}; 5xx {tally.server_errors}; hangs {tally.hangs}; kv back {'yes' if back else 'no'}")


if __name__ == "__main__":
    main()
