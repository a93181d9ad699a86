"""Property-based requests against a running SmartSpec server: nothing a client sends gets a 5xx or hangs, and the
server is healthy with every KV block free afterwards.

Requests are drawn by hypothesis: both endpoints, and the Serve handle (every fourth request, unary and streamed,
where this process can reach the application: the fuzzer joins the running Ray cluster); any number of the API's
fields at once (`response_format`, `tools`, `tool_choice`, `logit_bias`, `prediction`, `structured_outputs`,
`speculation`, `stop`, `n`, `logprobs`, sampling controls, streams with hang-ups). Half the requests are drawn
valid in every field, so that many reach the engine with many features at once; the other half mix in wrong types,
out-of-range numbers, odd unicode, huge and deeply nested values. `--clients` send at once. Per request: its status
(a 5xx, an error event of a 5xx inside a stream, or a stream that ends without `[DONE]` is a failure), whether a
4xx names what is wrong, and whether it ended within --timeout seconds (a hang otherwise). Writes
results/fuzz_api.jsonl (one line per request: endpoint, status, seconds, and the body of any failure) and prints,
last, `requests N; 5xx F; hangs H; kv back yes|no`, after a `statuses` line (how many were answered 200).

    serve run config-light.yaml &            # or any served config
    python scripts/fuzz_api.py --requests 3000 --clients 8 [--url http://127.0.0.1:8000] [--app smartspec]

Its figures: docs/benchmarks.md, "Fuzzing the API"; docs/serving.md, "Operating under faults"."""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
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


# each field: (a value the API takes, a value it may refuse); a valid request draws the first alone
NUMBERS = {
    "temperature": (st.one_of(st.just(0), st.floats(0, 2)),
                    st.one_of(st.floats(-10, 10), st.sampled_from([1e308, float("nan"), float("inf")]))),
    "top_p": (st.floats(0.01, 1), st.one_of(st.floats(-1, 2), st.just(float("nan")))),
    "top_k": (st.integers(0, 100), st.integers(-5, 0)),
    "min_p": (st.floats(0, 1), st.floats(-1, 2)),
    "seed": (st.integers(0, 2**32), st.integers(-2**70, 2**70)),
    "presence_penalty": (st.floats(-2, 2), st.floats(-9, 9)),
    "frequency_penalty": (st.floats(-2, 2), st.floats(-9, 9)),
    "repetition_penalty": (st.floats(0.5, 2), st.floats(-1, 3)),
    "min_tokens": (st.integers(0, 4), st.integers(-2, 12)),
}
VALID_STRUCTURED = st.one_of(
    st.builds(lambda r: {"regex": r}, st.sampled_from([r"\d{1,3}", r"(yes|no)", "[a-z]+", "[A-Z][a-z]{0,6}"])),
    st.builds(lambda c: {"choice": c}, st.lists(st.sampled_from(["red", "green", "blue", "42", "ok"]), min_size=1,
                                                max_size=3, unique=True)),
    st.builds(lambda s: {"json": s}, st.sampled_from([{"type": "integer"}, {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8}}, "required": ["name"]}, {"enum": ["a", "b"]}])),
    st.just({"json_object": True}), st.just({"grammar": 'start: "yes" | "no"'}))
VALID_TOOL = st.builds(lambda name: {"type": "function", "function": {"name": name, "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}},
    st.sampled_from(["get_weather", "lookup", "add"]))


def fields_of(chat: bool) -> dict[str, tuple[st.SearchStrategy, st.SearchStrategy]]:
    """Every field of the endpoint: (valid values, any values)."""
    common = {
        "max_tokens": (st.integers(1, 8), st.one_of(st.integers(-3, 0), st.just(10**9))),
        "n": (st.integers(1, 3), st.sampled_from([0, 9, 10**6])),
        "stop": (st.one_of(st.none(), st.lists(st.sampled_from(["\n", "."]), max_size=2)),
                 st.one_of(ODD_TEXT, st.lists(ODD_TEXT, max_size=5))),
        "logit_bias": (st.dictionaries(st.integers(0, 200).map(str), st.floats(-100, 100), max_size=4),
                       st.dictionaries(st.one_of(st.integers(-5, 200_000).map(str), ODD_TEXT),
                                       st.floats(-1e6, 1e6), max_size=4)),
        "stream": (st.booleans(), st.booleans()),
        "stream_options": (st.one_of(st.none(), st.just({"include_usage": True})), JUNK),
        "structured_outputs": (VALID_STRUCTURED, STRUCTURED),
        "response_format": (st.sampled_from([{"type": "text"}, {"type": "json_object"}]), RESPONSE_FORMAT),
        "prediction": (st.builds(lambda c: {"type": "content", "content": c}, st.sampled_from(["def f(x):", "ab"])),
                       st.builds(lambda c: {"type": "content", "content": c}, TEXT)),
        "speculation": (st.builds(lambda k: {"max_k": k}, st.integers(0, 8)),
                        st.builds(lambda k: {"max_k": k}, st.integers(-2, 40))),
        "ignore_eos": (st.booleans(), JUNK),
        **NUMBERS,
    }
    if chat:
        return {**common, "logprobs": (st.booleans(), JUNK), "top_logprobs": (st.integers(0, 5), st.integers(-1, 25)),
                "tools": (st.lists(VALID_TOOL, max_size=2, unique_by=lambda t: t["function"]["name"]),
                          st.lists(TOOL, max_size=3)),
                "tool_choice": (st.sampled_from(["none", "auto"]),
                                st.one_of(st.sampled_from(["required", "sometimes"]),
                                          st.builds(lambda n: {"type": "function", "function": {"name": n}},
                                                    ODD_TEXT))),
                "parallel_tool_calls": (st.booleans(), JUNK),
                "max_completion_tokens": (st.integers(1, 8), st.integers(-1, 0))}
    return {**common, "logprobs": (st.integers(0, 5), st.integers(-1, 25)), "echo": (st.booleans(), JUNK)}


MESSAGE = st.builds(lambda role, content: {"role": role, "content": content},
                    st.sampled_from(["user", "user", "user", "system", "assistant", "developer", "tool", "robot"]),
                    maybe(st.one_of(TEXT, st.just([{"type": "text", "text": "hi"}]))))
VALID_MESSAGES = st.lists(st.builds(lambda c: {"role": "user", "content": c},
                                    st.sampled_from(["hello", "def f(x):", "Name three colours."])),
                          min_size=1, max_size=2)


@st.composite
def requests(draw, model: str) -> tuple[str, dict, bool]:
    """(endpoint, body, hang up early): any number of the endpoint's fields; valid in every one half the time,
    else each drawn as maybe()."""
    chat, valid = draw(st.booleans()), draw(st.booleans())
    fields = fields_of(chat)

    def value(name: str):
        good, anything = fields[name]
        return draw(good) if valid else draw(maybe(mostly(good, anything)))
    body = {"model": model if valid else draw(maybe(st.just(model)))}
    if chat:
        body["messages"] = draw(VALID_MESSAGES) if valid else draw(maybe(st.lists(MESSAGE, min_size=1, max_size=4)))
    else:
        prompts = st.one_of(TEXT, st.lists(st.integers(-5, 200_000), max_size=8), st.lists(TEXT, min_size=1,
                                                                                            max_size=3))
        body["prompt"] = draw(st.sampled_from(["hello", "def f(x):", "ab ab ab"])) if valid else draw(maybe(prompts))
    if valid or draw(st.integers(0, 49)):  # without it, a chat runs to the context's end: one odd request in fifty
        body["max_tokens"] = value("max_tokens")
    for name in draw(st.lists(st.sampled_from(sorted(fields)), unique=True)):
        body[name] = value(name)
    if not valid and draw(st.integers(0, 30)) == 0:
        body[draw(st.sampled_from(sorted(fields)))] = draw(DEEP)
    if not valid and draw(st.integers(0, 30)) == 0:
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
        done = False
        for i, line in enumerate(r.iter_lines()):
            if hang_up and i >= 2:
                return "hung-up", None  # the client goes away mid-stream: its request must be aborted
            if line == "data: [DONE]":
                done = True
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            problem = _stream_problem(_json(line[6:]), line)
            if problem is not None:
                return problem
    return (200, None) if done else (200, "the stream ended without [DONE]")


def _stream_problem(event, line: str) -> tuple[int, str] | None:
    """A stream event that is a failure: not JSON, or an error of a 5xx."""
    if event is None:
        return 200, f"a stream event is not JSON: {line[:200]!r}"
    if isinstance(event, dict) and "error" in event and (event["error"] or {}).get("code", 500) >= 500:
        return event["error"].get("code", 500), f"error event: {event['error'].get('message')!r}"
    return None


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


def call_handle(handle, endpoint: str, body: dict, timeout: float):
    """The same request through the Serve handle: OpenAIIngress.create, or create_stream (handle.options(stream=
    True)) for a streamed body, whose chunks are read to the end; an answer, or an error dict."""
    chat, fields = endpoint.endswith("chat/completions"), {k: v for k, v in body.items() if k != "stream"}
    if body.get("stream") is not True:
        answer = handle.create.remote(fields, chat=chat).result(timeout_s=timeout)
        status = (answer.get("error") or {}).get("code", 200) if isinstance(answer, dict) else 500
        return status, _problem(status, answer)
    chunks = handle.options(stream=True).create_stream.remote(fields, chat=chat)
    status = 200
    for chunk in chunks:
        if isinstance(chunk, dict) and "error" in chunk:
            status = (chunk["error"] or {}).get("code", 500)
            if status >= 500 or not (chunk["error"] or {}).get("message"):
                return status, _problem(status, chunk) or f"error chunk: {chunk!r}"[:2000]
        elif not isinstance(chunk, dict):
            return 500, f"a stream chunk is not a dict: {chunk!r}"[:2000]
    return status, None


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


def draw_requests(model: str, num_requests: int, seed: int) -> list[tuple[str, dict, bool]]:
    """num_requests drawn requests, the same for the same seed."""
    drawn: list[tuple[str, dict, bool]] = []
    while len(drawn) < num_requests:
        @hypothesis_seed(seed + len(drawn))
        @settings(max_examples=num_requests - len(drawn), deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(requests(model))
        def one(request):
            drawn.append(request)
        one()
    return drawn[:num_requests]


@dataclass(frozen=True)
class FuzzTarget:
    """The server fuzzed: its URL, the model name clients send, its Serve handle (None: HTTP alone), its API key."""
    url: str
    model: str
    handle: object = None
    key: str | None = None


@dataclass(frozen=True)
class FuzzRun:
    """How many requests, from how many clients at once, each waited on for at most timeout seconds; the seed
    they are drawn from, where raw rows go (None: nowhere) and whether progress is printed."""
    num_requests: int
    timeout: float = 120
    clients: int = 1
    seed: int = 0
    out: Path | None = None
    progress: bool = True


def fuzz(target: FuzzTarget, run: FuzzRun) -> tuple[Tally, bool]:
    """Send run.num_requests drawn requests from run.clients at once (every fourth through the handle, when
    given); the tally and whether the server is healthy with its KV blocks free afterwards."""
    url, model, handle, key = target.url, target.model, target.handle, target.key
    num_requests, timeout, out, seed, progress, clients = (run.num_requests, run.timeout, run.out, run.seed,
                                                           run.progress, run.clients)
    tally, rows, lock = Tally(), [], threading.Lock()
    local = threading.local()

    def one(index: int, drawn: tuple[str, dict, bool]) -> None:
        endpoint, body, hang_up = drawn
        if not hasattr(local, "client"):
            local.client = httpx.Client(timeout=timeout)
        start = time.monotonic()
        try:
            if handle is not None and index % 4 == 3:
                status, problem = call_handle(handle, endpoint, body, timeout)
            else:
                status, problem = send(local.client, url, endpoint, body, hang_up, key)
        except (httpx.TimeoutException, TimeoutError) as exc:
            status, problem = "hang", f"no answer in {timeout:g} s ({exc!r})"
        except httpx.HTTPError as exc:
            status, problem = "transport", repr(exc)
        except Exception as exc:  # the handle's call failed: the server did not answer it
            status, problem = 500, repr(exc)[:2000]
        with lock:
            if status == "hang":
                tally.hangs += 1
            elif status == "transport" or status == 200 and problem or isinstance(status, int) and status >= 500:
                tally.server_errors += 1  # a 5xx, a broken connection, a broken answer or stream
            elif problem is not None:
                tally.unnamed += 1  # a 4xx without a message
            rows.append(tally.add(endpoint, body, status, time.monotonic() - start, problem))
            if progress and tally.requests % 100 == 0:
                print(f"  {tally.requests} requests; 5xx {tally.server_errors}; hangs {tally.hangs}; "
                      f"statuses {dict(sorted(tally.by_status.items()))}", file=sys.stderr, flush=True)

    with ThreadPoolExecutor(max_workers=clients) as pool:
        list(pool.map(one, *zip(*enumerate(draw_requests(model, num_requests, seed)))))
    healthy = httpx.get(f"{url}/health", timeout=30).status_code == 200
    back = healthy and kv_back(url, key)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("".join(json.dumps(r, default=repr) + "\n" for r in rows))
    return tally, back


def serve_handle(app: str):
    """The application's ingress handle, where this process can join the Ray cluster that serves it; else None."""
    try:
        import ray
        from ray import serve

        ray.init(address="auto", namespace="serve", log_to_driver=False, ignore_reinit_error=True)
        return serve.get_app_handle(app)
    except Exception as exc:
        print(f"no Serve handle for app {app!r} ({exc!r}): HTTP alone", file=sys.stderr)
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="the served model name (default: the server's /v1/models)")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--timeout", type=float, default=120, help="seconds after which a request counts as hung")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clients", type=int, default=8, help="requests in flight at once")
    ap.add_argument("--app", default="smartspec", help="the Serve application whose handle is fuzzed too")
    ap.add_argument("--no-handle", action="store_true", help="HTTP alone")
    ap.add_argument("--out", default="results/fuzz_api.jsonl")
    args = ap.parse_args()
    if args.requests < 1 or args.clients < 1:
        ap.error("--requests and --clients must be at least 1")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        model = args.model or httpx.get(f"{args.url}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, ValueError) as exc:
        sys.exit(f"no SmartSpec server answers at {args.url} ({exc!r}); start one, e.g. `serve run config-light.yaml`")
    handle = None if args.no_handle else serve_handle(args.app)
    print(f"fuzzing {args.url} ({model}) with {args.requests} requests from {args.clients} clients"
          f"{' and its Serve handle' if handle is not None else ''}", file=sys.stderr)
    tally, back = fuzz(FuzzTarget(args.url, model, handle, args.api_key),
                       FuzzRun(args.requests, args.timeout, args.clients, args.seed, Path(args.out)))
    for failure in tally.failures[:20]:
        print(json.dumps(failure, default=repr)[:600])
    print(f"statuses {dict(sorted(tally.by_status.items()))}; 4xx without a message {tally.unnamed}; "
          f"raw rows: {args.out}")
    print(f"requests {tally.requests}; 5xx {tally.server_errors}; hangs {tally.hangs}; "
          f"kv back {'yes' if back else 'no'}")


if __name__ == "__main__":
    main()
