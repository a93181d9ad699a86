"""The Ray Serve application end to end: a real Ray instance, real HTTP, the official openai client, tiny models.
One Ray instance for the whole module (start-up is the slow part); stopped at the end."""
import asyncio
import os
import json
from concurrent.futures import ThreadPoolExecutor
import re
import time

import httpx
import pytest

ray = pytest.importorskip("ray")
from served import wait_ready  # noqa: E402
from tool_defs import ADD, WEATHER  # noqa: E402

from ray import serve  # noqa: E402

from smartspec import LLM, SamplingParams  # noqa: E402

PROMPTS = ["hello world", "def f(x):\n    return", "abcabcabc abc", "The quick brown fox", "12345 12345 123"]


@pytest.fixture(scope="module")
def app(ray_serve, tiny_qwen, tiny_qwen_draft):
    """Two replicas, each with a draft actor; policy fixed so that every step speculates while it can."""
    from deployments.app import build_app

    args = {"model": tiny_qwen, "served_model_name": "tiny",
            "speculation": {"method": "draft_model", "model": tiny_qwen_draft, "num_speculative_tokens": 3,
                            "policy": "fixed", "draft_num_cpus": 0.1, "draft_num_threads": 1},
            "kv_cache_gib": 0.01, "max_model_len": 512, "num_replicas": 2, "replica_num_cpus": 0.2,
            "num_threads": 1, "controller_interval_s": 0.5}
    serve.run(build_app(args), name="main", route_prefix="/")
    wait_ready(ray_serve)
    return ray_serve


@pytest.fixture(scope="module")
def reference(tiny_qwen):
    llm = LLM(tiny_qwen, num_kv_blocks=256, max_model_len=512)

    def run(prompt: str, max_tokens: int, chat: bool = False) -> str:
        if chat:
            prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                       add_generation_prompt=True)
        return llm.generate(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0].text

    return run


def _client(url: str):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _server_stats() -> list[dict]:
    handle = serve.get_deployment_handle("LLMServer", "main")
    # one call per replica is not addressable; ask often enough to see both
    seen = {}
    for _ in range(20):
        s = handle.stats.remote().result(timeout_s=30)
        seen[s["replica"]] = s
        if len(seen) == 2:
            break
    return list(seen.values())


def _all_blocks_free(timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = _server_stats()
        if len(stats) == 2 and all(s["free_blocks"] == s["total_blocks"] and s["in_flight"] == 0 for s in stats):
            return True
        time.sleep(0.5)
    return False


def test_openai_client_completions_and_chat_equal_offline_engine(app, reference):
    client = _client(app)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    for prompt in PROMPTS[:3]:
        want = reference(prompt, 24)
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert got.choices[0].text == want
        assert got.choices[0].finish_reason == "length" and got.usage.completion_tokens == 24
        stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in stream) == want
    want = reference("Say hi", 20, chat=True)
    got = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Say hi"}],
                                         max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    assert got.choices[0].message.content == want and got.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Say hi"}],
                                                 max_tokens=20, temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_choices_unary_and_streamed(app, reference):
    want = reference(PROMPTS[0], 10)
    r = httpx.post(f"{app}/v1/completions", json={"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 10, "n": 2,
                                                  "temperature": 0, "ignore_eos": True}, timeout=60).json()
    assert [c["index"] for c in r["choices"]] == [0, 1] and all(c["text"] == want for c in r["choices"])
    assert r["usage"]["completion_tokens"] == 20
    texts = ["", ""]
    with httpx.stream("POST", f"{app}/v1/completions", json={"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 10,
                                                              "n": 2, "temperature": 0, "ignore_eos": True,
                                                              "stream": True}, timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                c = json.loads(line[6:])["choices"][0]
                texts[c["index"]] += c["text"]
    assert texts == [want, want]


def test_an_unstreamed_answer_leaves_its_replica_in_a_few_messages(app):
    """A streamed call gets a delta a step; an answer sent whole gets its first tokens at once, then a batch at most
    every HELD_DELTAS_S: the same tokens in fewer messages for the front and Ray to carry."""
    import math

    from deployments.replica.deltas import HELD_DELTAS_S
    from deployments.wire import Delta, GenerateCall

    handle = serve.get_deployment_handle("LLMServer", "main").options(stream=True)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    sent = {}
    for streamed in (True, False):
        start = time.monotonic()
        events = list(handle.generate.remote(GenerateCall(params, prompt=PROMPTS[1], streamed=streamed)))
        sent[streamed] = [e for e in events if isinstance(e, Delta)], time.monotonic() - start
    (each_step, _), (held, took) = sent[True], sent[False]
    assert sum((d.token_ids for d in held), []) == sum((d.token_ids for d in each_step), [])
    assert "".join(d.text for d in held) == "".join(d.text for d in each_step)
    assert len(sum((d.token_ids for d in held), [])) == 40 and held[-1].finished and held[0].first
    assert len(each_step) >= 10  # four tokens a step at most (k = 3)
    assert len(held) <= 2 + math.ceil(took / HELD_DELTAS_S)


def test_sse_wire_format_ends_with_done(app):
    with httpx.stream("POST", f"{app}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 5,
                                                              "stream": True, "temperature": 0}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] in ("length", "stop")
    with httpx.stream("POST", f"{app}/v1/completions", json={
            "model": "tiny", "prompt": "hi", "max_tokens": 5, "stream": True, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True}}, timeout=60) as r:
        events = [line for line in r.iter_lines() if line]
    last = json.loads(events[-2][6:])
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 5


def test_32_concurrent_streams_complete_unmixed_and_free_their_blocks(app, reference):
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} #{i}" for i in range(32)]
    want = [reference(p, 16 + i % 9) for i, p in enumerate(prompts)]

    async def one(client, i):
        async with client.stream("POST", f"{app}/v1/completions", json={
                "model": "tiny", "prompt": prompts[i], "max_tokens": 16 + i % 9, "stream": True, "temperature": 0,
                "ignore_eos": True}) as r:
            assert r.status_code == 200
            text, done = "", False
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    text += json.loads(line[6:])["choices"][0]["text"]
            assert done
            return text

    async def main():
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    assert asyncio.run(main()) == want
    assert _all_blocks_free()


def test_client_disconnect_aborts_request_and_frees_blocks(app):
    with httpx.stream("POST", f"{app}/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 480,
                                                              "stream": True, "ignore_eos": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # one chunk, then hang up with ~470 tokens to go
    assert _all_blocks_free()


def test_killed_draft_actor_restarts_and_requests_finish_unchanged(app, reference):
    stats = _server_stats()
    before = {s["replica"]: s["draft_incarnation"] for s in stats}
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} kill {i}" for i in range(6)]
    want = [reference(p, 200) for p in prompts]

    async def one(client, i, started: asyncio.Event):
        async with client.stream("POST", f"{app}/v1/completions", json={
                "model": "tiny", "prompt": prompts[i], "max_tokens": 200, "stream": True, "temperature": 0,
                "ignore_eos": True}) as r:
            text = ""
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
                    started.set()
            return text

    async def main():
        async with httpx.AsyncClient(timeout=300) as client:
            events = [asyncio.Event() for _ in prompts]
            tasks = [asyncio.create_task(one(client, i, events[i])) for i in range(len(prompts))]
            await asyncio.gather(*(e.wait() for e in events))
            for s in stats:  # mid-run: every request has streamed and none has finished its 200 tokens
                ray.kill(ray.get_actor(s["draft_actor"], namespace=s["namespace"]), no_restart=False)
            return await asyncio.gather(*tasks)

    assert asyncio.run(main()) == want
    # the restart is automatic; speculation resumes with the new incarnation
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        after = {s["replica"]: s for s in _server_stats()}
        if all(after[r]["draft_available"] and after[r]["draft_incarnation"] != before[r] for r in before):
            break
        time.sleep(1)
    else:
        pytest.fail(f"draft actors did not come back: {after}")
    got = _client(app).completions.create(model="tiny", prompt="after the restart", max_tokens=20, temperature=0)
    assert got.choices[0].speculation["num_drafts"] > 0


def test_controller_merges_both_replicas_and_status_and_metrics(app):
    httpx.post(f"{app}/v1/completions", json={"model": "tiny", "prompt": "warm", "max_tokens": 8}, timeout=60)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status = httpx.get(f"{app}/v1/smartspec/status", timeout=30).json()
        # policy "fixed" has no state to merge: the status still lists both replicas; and the one that served the
        # request has reported its steps (the controller polls every 0.5 s: read too early, the counters are zero)
        if len(status["replicas"]) == 2 and status["merged_policy"] is None and \
                any(r["steps"]["steps"] for r in status["replicas"].values()):
            break
        time.sleep(0.5)
    assert len(status["replicas"]) == 2
    assert all("running" in r and "spec_decode" in r for r in status["replicas"].values())
    text = httpx.get(f"{app}/metrics", timeout=30).text
    for name in ("smartspec_requests_total", "smartspec_time_to_first_token_seconds_bucket",
                 "smartspec_spec_decode_num_accepted_tokens_total", "smartspec_chosen_k_total",
                 "smartspec_goodput_tokens_per_second"):
        assert name in text, name


def test_requests_complete_while_the_controller_is_gone(app, reference):
    names = [a for a in ray.util.list_named_actors(all_namespaces=True) if "GoodputController" in a["name"]
             and "main" in a["name"]]
    assert names, ray.util.list_named_actors(all_namespaces=True)
    for a in names:
        ray.kill(ray.get_actor(a["name"], namespace=a["namespace"]), no_restart=True)
    client = _client(app)
    for prompt in PROMPTS[3:]:
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert got.choices[0].text == reference(prompt, 16)


def test_python_handle_streaming_and_unary(app, reference):
    handle = serve.get_app_handle("main")
    body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    out = handle.create.remote(body).result(timeout_s=120)
    assert out["choices"][0]["text"] == reference(PROMPTS[1], 12)
    chunks = list(handle.options(stream=True).create_stream.remote(body))
    assert "".join(c["choices"][0]["text"] for c in chunks) == reference(PROMPTS[1], 12)
    bad = handle.create.remote({**body, "model": "nope"}).result(timeout_s=60)
    assert bad["error"]["code"] == 404


def test_the_load_generator_drives_the_server(app, tmp_path):
    """`smartspec bench serve`: Poisson and one-at-a-time arrivals against the served app, every request answered,
    per-request rows and per-rate summaries written, the server's spec-decode counters read from /metrics."""
    import pandas as pd

    from smartspec.cli import main

    # the replicas' counters reach /metrics through the controller: wait until they are there (earlier tests ran)
    def metrics() -> str:
        try:
            return httpx.get(f"{app}/metrics", timeout=30).text
        except httpx.HTTPError:  # the controller may still be coming back from an earlier test's kill
            return ""

    deadline = time.monotonic() + 120
    while "smartspec_spec_decode_num_draft_tokens_total" not in metrics():
        assert time.monotonic() < deadline, "no spec-decode counters on /metrics"
        time.sleep(0.5)
    argv = ["bench", "serve", "--url", app, "--model", "tiny", "--label", "tiny-fixed", "--workload", "humaneval",
            "--rates", "0", "4", "--num-requests", "2", "--max-tokens", "4", "--ignore-eos", "--out", str(tmp_path)]
    assert main(argv) == 0
    rows = pd.read_parquet(tmp_path / "tiny-fixed.parquet")
    assert sorted(rows.rate) == [0, 0, 4, 4] and rows.error.isna().all() and (rows.output_tokens == 4).all()
    summary = pd.read_parquet(tmp_path / "tiny-fixed_summary.parquet")
    assert list(summary.rate) == [0, 4] and (summary.errors == 0).all()
    # the server's spec-decode counters were read at every rate (how much each delta holds depends on when the
    # replicas last reported, so only that they were read, and never went backwards)
    counters = summary[["spec_drafts", "spec_draft_tokens", "spec_accepted_tokens"]]
    assert counters.notna().all().all() and (counters >= 0).all().all()
    assert (tmp_path / "latency_vs_rate.png").stat().st_size > 0
    # a closed loop of 2 in flight: the first two start together, and no request starts while two are running
    assert main(["bench", "serve", "--url", app, "--model", "tiny", "--label", "tiny-c2", "--workload", "humaneval",
                 "--rates", "0", "--concurrency", "2", "--num-requests", "4", "--max-tokens", "4", "--ignore-eos",
                 "--out", str(tmp_path)]) == 0
    rows = pd.read_parquet(tmp_path / "tiny-c2.parquet").sort_values("start")
    spans = list(zip(rows.start, rows.start + rows.latency_s))
    assert spans[1][0] < spans[0][1] and len(spans) == 4 and (rows.concurrency == 2).all()
    assert all(sum(s0 <= start < s1 for s0, s1 in spans[:i]) <= 1 for i, (start, _) in enumerate(spans))
    assert pd.read_parquet(tmp_path / "tiny-c2_summary.parquet").concurrency.tolist() == [2]
    assert main(argv[:3] + ["http://127.0.0.1:9"] + argv[4:]) == 1  # no server there: said, not a traceback


@pytest.mark.parametrize("body, status, message", [
    ("{not json", 400, "not valid JSON"),
    ("[1, 2]", 400, "must be a JSON object"),
    ({"model": "tiny"}, 400, "prompt: Field required"),
    ({"prompt": "x"}, 400, "model: Field required"),
    ({"model": "gpt-4", "prompt": "x"}, 404, "The model `gpt-4` does not exist"),
    ({"model": "tiny", "prompt": "x", "temperature": 3}, 400, "temperature"),
    ({"model": "tiny", "prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "n": 0}, 400, "n:"),
    ({"model": "tiny", "prompt": "y" * 600}, 400, "the context holds 512"),
    ({"model": "tiny", "prompt": [10**9]}, 400, "token ids must be integers"),
    ({"model": "tiny", "prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ({"model": "tiny", "prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"model": "tiny", "prompt": "x", "logit_bias": {"a": 10}}, 400, "logit_bias"),
    ({"model": "tiny", "prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ({"model": "tiny", "prompt": "x", "logit_bias": {"100000": 1}}, 400, "logit_bias"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
    ({"model": "tiny", "prompt": "x", "min_p": -0.1}, 400, "min_p"),
    ({"model": "tiny", "prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "bogus"}}}}, 400, "invalid JSON schema"),
    ({"model": "tiny", "prompt": "x", "structured_outputs": {"regex": "a["}}, 400, "invalid regex"),
    ({"model": "tiny", "prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400, "exactly one"),
    ({"model": "tiny", "prompt": "x", "response_format": {"type": "json_schema"}}, 400, "response_format"),
    ({"model": "tiny", "prompt": "x", "prediction": {"type": "file", "content": "x"}}, 400, "prediction.type"),
    ({"model": "tiny", "prompt": "x", "best_of": 3}, 400, "`best_of` is not supported"),
    # impossible constraints (structured/feasible.py): refused, never started
    ({"model": "tiny", "prompt": "x", "structured_outputs": {"regex": "()"}, "min_tokens": 1}, 400, "min_tokens"),
    ({"model": "tiny", "prompt": "x", "structured_outputs": {"choice": ["a"]}, "logit_bias": {"64": -100}}, 400,
     "logit_bias"),
])
def test_bad_input_gets_openai_error(app, body, status, message):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(f"{app}/v1/completions", content=content, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert message in err["message"] and err["code"] == status and err["type"]
    if message.replace(".", "_").isidentifier():  # a field's name: the error names it as its param
        assert err["param"] == message, err


def test_structured_outputs_through_the_openai_client(app, tiny_qwen):
    """response_format json_schema on chat, streamed and not, on replicas that speculate: valid against the schema
    and the offline engine's greedy output without speculation; a regex and a choice on completions."""
    import jsonschema

    from smartspec.types.sampling_params import StructuredOutput

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 50}},
              "required": ["name", "n"], "additionalProperties": False}
    llm = LLM(tiny_qwen, num_kv_blocks=256, max_model_len=512)
    messages = [{"role": "user", "content": "Give a name and a number as JSON."}]
    prompt = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    want = llm.generate(prompt, SamplingParams(max_tokens=100, structured=StructuredOutput(json=schema)))[0].text
    client = _client(app)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    got = client.chat.completions.create(model="tiny", messages=messages, max_tokens=100, temperature=0,
                                         response_format=fmt)
    assert got.choices[0].message.content == want and got.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(want), schema)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=100, temperature=0,
                                            response_format=fmt, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == want
    text = client.completions.create(model="tiny", prompt="email:", max_tokens=40, temperature=0,
                                     extra_body={"structured_outputs": {"regex": "[a-z]{3,8}@test\\.org"}})
    assert re.fullmatch(r"[a-z]{3,8}@test\.org", text.choices[0].text), text.choices[0].text
    pick = client.completions.create(model="tiny", prompt="mood:", max_tokens=10, temperature=0,
                                     extra_body={"guided_choice": ["happy", "sad"]})
    assert pick.choices[0].text in ("happy", "sad")


def test_a_tool_calling_round_trip_through_the_openai_client(app):
    """question -> tool_calls (required, then a named function; unary and streamed) -> the tool's result -> an
    answer; bad tools are refused naming the field."""
    import jsonschema

    client = _client(app)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    got = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, ADD],
                                         tool_choice="required", max_tokens=200, temperature=0)
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    named = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, ADD], max_tokens=200,
                                           tool_choice={"type": "function", "function": {"name": "add"}},
                                           parallel_tool_calls=False, temperature=0)
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "add"
    # streamed: the calls arrive as deltas that add up to the unary answer's
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, ADD],
                                                 tool_choice="required", max_tokens=200, temperature=0,
                                                 stream=True))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert [(d.function.name, d.function.arguments) for d in deltas] == \
        [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert [d.index for d in deltas] == list(range(len(deltas))) and all(d.id for d in deltas)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the tool's result goes back; with tool_choice auto the model answers (random weights: text, no call)
    follow = messages + [choice.message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": "18 C"} for c in choice.message.tool_calls]
    answer = client.chat.completions.create(model="tiny", messages=follow, tools=[WEATHER, ADD], max_tokens=8,
                                            temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    for body, param in [({"tools": [{"type": "function", "function": {"description": "no name"}}]},
                         "tools.0.function.name"),
                        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                         "tool_choice"),
                        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
                         "tool_choice")]:
        r = httpx.post(f"{app}/v1/chat/completions", json={"model": "tiny", "messages": messages, **body},
                       timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_parallel_tool_calls_false_keeps_an_auto_answers_first_call(app):
    """parallel_tool_calls false with tool_choice "auto": the answer carries one call, unary and streamed; true
    keeps both. A grammar makes the random model call twice (its byte tokenizer spells the tags out, so the front
    keeps the first call; test_tools stops Qwen2.5 at its closing-tag token). A grammar naming a special token the
    model does not have is a 400 from the replica's check, not a failed generation."""
    block = '"<tool_call>" ' + json.dumps('\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n') + ' "</tool_call>"'
    two_calls = {"structured_outputs": {"grammar": f'start: {block} "\\n" {block}'}}
    client = _client(app)
    messages = [{"role": "user", "content": "Add 1 and 2, twice."}]
    kw = dict(model="tiny", messages=messages, tools=[WEATHER, ADD], max_tokens=200, temperature=0,
              extra_body=two_calls)
    both = client.chat.completions.create(parallel_tool_calls=True, **kw)
    one = client.chat.completions.create(parallel_tool_calls=False, **kw)
    assert [c.function.name for c in both.choices[0].message.tool_calls] == ["add", "add"]
    assert [c.function.name for c in one.choices[0].message.tool_calls] == ["add"]
    assert one.choices[0].finish_reason == "tool_calls" and one.choices[0].message.content is None
    chunks = list(client.chat.completions.create(parallel_tool_calls=False, stream=True, **kw))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert [d.function.arguments for d in deltas] == [one.choices[0].message.tool_calls[0].function.arguments]
    r = httpx.post(f"{app}/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": messages, "structured_outputs": {"grammar": 'start: <tool_call> "x"'}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs.grammar", r.text


def test_predicted_outputs_are_drafted_and_counted_in_usage(app, tiny_qwen):
    """OpenAI's prediction: the answer is unchanged, the prediction's tokens are drafted and the usage says how many
    were accepted and rejected (unary and streamed)."""
    from smartspec.types.sampling_params import StructuredOutput

    llm = LLM(tiny_qwen, num_kv_blocks=256, max_model_len=512)
    messages = [{"role": "user", "content": PROMPTS[1]}]
    prompt = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # random weights write arbitrary bytes, which do not survive as text: a regex keeps the answer to letters
    letters = {"structured_outputs": {"regex": "[a-z ]{48,60}"}, "ignore_eos": True}
    want = llm.generate(prompt, SamplingParams(max_tokens=48, ignore_eos=True,
                                               structured=StructuredOutput(regex="[a-z ]{48,60}")))[0].text
    predicted = want[:30] + "X" + want[31:]  # an edit in the middle
    client = _client(app)
    got = client.chat.completions.create(model="tiny", messages=messages, max_tokens=48, temperature=0,
                                         prediction={"type": "content", "content": predicted}, extra_body=letters)
    assert got.choices[0].message.content == want
    details = got.usage.completion_tokens_details
    # the edit at character 30 is drafted with the prediction and rejected: at least one token
    assert details.accepted_prediction_tokens >= 24 and details.rejected_prediction_tokens >= 1
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=48, temperature=0,
                                            prediction={"type": "content", "content": predicted}, stream=True,
                                            stream_options={"include_usage": True}, extra_body=letters)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens >= 24
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
    assert plain.usage.completion_tokens_details is None  # only requests with a prediction carry the details


def test_sampling_controls_are_served_as_the_offline_engine_makes_them(app, tiny_qwen):
    """Penalties, logit_bias, min_p and min_tokens through the openai client, on replicas that speculate: the
    greedy text is the offline engine's without speculation; null means unset."""
    llm = LLM(tiny_qwen, num_kv_blocks=256, max_model_len=512)
    controls = dict(presence_penalty=0.8, frequency_penalty=0.5, repetition_penalty=1.3, logit_bias={70: 5.0},
                    min_p=0.1, min_tokens=12)
    want = llm.generate(PROMPTS[2], SamplingParams(max_tokens=24, **controls))[0]
    assert want.text != llm.generate(PROMPTS[2], SamplingParams(max_tokens=24))[0].text
    client = _client(app)
    extra = {k: controls[k] for k in ("repetition_penalty", "min_p", "min_tokens")}
    got = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=24, temperature=0,
                                    presence_penalty=0.8, frequency_penalty=0.5, logit_bias={"70": 5.0},
                                    extra_body=extra)
    assert got.choices[0].text == want.text
    assert got.model_dump()["choices"][0]["speculation"]["num_draft_tokens"] > 0  # drafts verified under them
    r = httpx.post(f"{app}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2,
                                                   "presence_penalty": None, "logit_bias": None}, timeout=60)
    assert r.status_code == 200, r.text


def test_chat_logprobs_are_the_offline_engines_and_stream_alike(app, tiny_qwen):
    llm = LLM(tiny_qwen, num_kv_blocks=256, max_model_len=512)
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[2]}], tokenize=False,
                                               add_generation_prompt=True)
    want = llm.generate(prompt, SamplingParams(max_tokens=10, ignore_eos=True, logprobs=2))[0]
    body = {"model": "tiny", "messages": [{"role": "user", "content": PROMPTS[2]}], "max_tokens": 10,
            "temperature": 0, "ignore_eos": True, "logprobs": True, "top_logprobs": 2}
    got = httpx.post(f"{app}/v1/chat/completions", json=body, timeout=120).json()["choices"][0]["logprobs"]
    assert [e["logprob"] for e in got["content"]] == [lp.logprob for lp in want.logprobs]  # bitwise, via JSON
    assert [[t["logprob"] for t in e["top_logprobs"]] for e in got["content"]] == \
        [[v for _, v in lp.top] for lp in want.logprobs]
    assert [e["token"] for e in got["content"]] == [llm.tokenizer.decode([t]) for t in want.token_ids]
    assert all(e["bytes"] == list(e["token"].encode()) for e in got["content"])
    # streamed: the chunks' entries, in order, are the same
    streamed = []
    with httpx.stream("POST", f"{app}/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                c = json.loads(line[6:])["choices"][0]
                streamed += (c.get("logprobs") or {}).get("content", [])
    assert streamed == got["content"]
    # the official client reads them
    out = _client(app).chat.completions.create(**{k: v for k, v in body.items() if k != "ignore_eos"},
                                              extra_body={"ignore_eos": True})
    assert [e.logprob for e in out.choices[0].logprobs.content] == [lp.logprob for lp in want.logprobs]
    r = httpx.post(f"{app}/v1/chat/completions", json={**body, "logprobs": False}, timeout=60)
    assert r.status_code == 400 and "top_logprobs needs logprobs" in r.json()["error"]["message"]
    plain = httpx.post(f"{app}/v1/chat/completions", json={k: v for k, v in body.items() if "logprobs" not in k},
                       timeout=120).json()
    assert plain["choices"][0]["logprobs"] is None


def test_completion_echo_with_logprobs(app, tiny_qwen):
    """lm-eval's loglikelihood request: echo, logprobs, one new token; the prompt's logprobs as the engine's."""
    llm = LLM(tiny_qwen, num_kv_blocks=256, max_model_len=512)
    want = llm.generate(PROMPTS[1], SamplingParams(max_tokens=1, logprobs=1, prompt_logprobs=1))[0]
    body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1}
    got = httpx.post(f"{app}/v1/completions", json=body, timeout=120).json()["choices"][0]
    lp = got["logprobs"]
    n = len(want.prompt_token_ids)
    assert got["text"] == PROMPTS[1] + want.text
    assert len(lp["tokens"]) == n + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == [p.logprob for p in want.prompt_logprobs[1:]] + [want.logprobs[0].logprob]
    assert "".join(lp["tokens"][:n]) == PROMPTS[1] and lp["text_offset"][0] == 0
    assert all(b - a == len(t) for a, b, t in zip(lp["text_offset"], lp["text_offset"][1:], lp["tokens"]))
    assert all(len(top) == 1 for top in lp["top_logprobs"][1:])
    streamed = []
    with httpx.stream("POST", f"{app}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                streamed.append(json.loads(line[6:])["choices"][0])
    assert "".join(c["text"] for c in streamed) == got["text"]
    assert [v for c in streamed if c["logprobs"] for v in c["logprobs"]["token_logprobs"]] == lp["token_logprobs"]
    echo_only = httpx.post(f"{app}/v1/completions", json={**body, "logprobs": None}, timeout=120).json()
    assert echo_only["choices"][0]["text"] == got["text"] and echo_only["choices"][0]["logprobs"] is None


def test_prefix_cache_hits_rise_on_a_repeated_system_prompt(app):
    system = "You are SmartSpec's test assistant; answer briefly. " * 4

    def hits() -> float:
        text = httpx.get(f"{app}/metrics", timeout=30).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("smartspec_prefix_cache_hits_total{"))

    before = hits()
    for question in ("one", "two", "three", "four"):  # two replicas: at least one sees the prompt twice
        body = {"model": "tiny", "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
        assert httpx.post(f"{app}/v1/chat/completions", json=body, timeout=120).status_code == 200
    deadline = time.monotonic() + 30
    while hits() < before + 200 and time.monotonic() < deadline:  # replicas report every 0.5 s
        time.sleep(0.5)
    assert hits() >= before + 200, (before, hits())


def test_a_batch_of_token_prompts_with_echo_is_answered_per_prompt(app, tiny_qwen):
    """The shape lm-eval's local-completions sends for loglikelihood: token-id prompts in one request."""
    llm = LLM(tiny_qwen, num_kv_blocks=256, max_model_len=512)
    batch = [llm.tokenizer(p)["input_ids"] for p in PROMPTS[:3]]
    body = {"model": "tiny", "prompt": batch, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1}
    got = httpx.post(f"{app}/v1/completions", json=body, timeout=120).json()
    assert [c["index"] for c in got["choices"]] == [0, 1, 2]
    assert got["usage"]["prompt_tokens"] == sum(map(len, batch))
    for ids, choice in zip(batch, got["choices"]):
        one = httpx.post(f"{app}/v1/completions", json={**body, "prompt": ids}, timeout=120).json()["choices"][0]
        assert choice["logprobs"] == one["logprobs"] and choice["text"] == one["text"]
        assert len(choice["logprobs"]["tokens"]) == len(ids) + 1
    r = httpx.post(f"{app}/v1/completions", json={**body, "prompt": [[1, 2], []]}, timeout=60)
    assert r.status_code == 400 and "no empty prompt" in r.json()["error"]["message"]


def test_chat_content_parts_are_text(app):
    """vLLM's benchmark client (and OpenAI's SDK for multimodal models) send content as a list of parts."""
    body = {"model": "tiny", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    plain = httpx.post(f"{app}/v1/chat/completions", json={**body, "messages": [
        {"role": "user", "content": "hello there"}]}, timeout=120).json()
    parts = httpx.post(f"{app}/v1/chat/completions", json={**body, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "there"}]}]},
        timeout=120).json()
    assert parts["choices"][0]["message"] == plain["choices"][0]["message"]
    r = httpx.post(f"{app}/v1/chat/completions", json={**body, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, timeout=60)
    assert r.status_code == 400 and "only text content parts" in r.json()["error"]["message"]


def test_chat_errors(app):
    r = httpx.post(f"{app}/v1/chat/completions", json={"model": "tiny", "messages": []}, timeout=60)
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = httpx.post(f"{app}/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "wizard",
                                                                                         "content": "x"}]}, timeout=60)
    assert r.status_code == 400 and "role" in r.json()["error"]["message"]


def test_proposers_chosen_per_request_are_served_from_the_config(ray_serve, tiny_qwen, tiny_qwen_draft, reference):
    """speculation.method [draft_model, suffix]: the draft in its actor, the lookups in the replica; output equal to
    the offline engine's without speculation, drafts proposed."""
    from deployments.app import build_app

    args = {"model": tiny_qwen, "served_model_name": "tiny",
            "speculation": {"method": ["draft_model", "suffix"], "model": tiny_qwen_draft, "num_speculative_tokens": 3,
                            "policy": "fixed", "draft_num_cpus": 0.1, "draft_num_threads": 1},
            "kv_cache_gib": 0.01, "max_model_len": 512, "replica_num_cpus": 0.1, "num_threads": 1}
    serve.run(build_app(args), name="mixed", route_prefix="/mixed")
    url = f"{ray_serve}/mixed"
    wait_ready(url)
    try:
        for prompt in ("abcabcabc abc", "hello world"):
            r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 24,
                                                          "temperature": 0, "ignore_eos": True}, timeout=120)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference(prompt, 24)
        stats = serve.get_deployment_handle("LLMServer", "mixed").stats.remote().result(timeout_s=30)
        assert stats["draft_available"] and stats["draft_actor"]
        assert stats["spec_decode"]["num_draft_tokens"] > 0
        by_source = stats["spec_decode"]["by_source"]
        assert by_source and set(by_source) <= {"draft_model", "suffix"}
        assert sum(c["num_draft_tokens"] for c in by_source.values()) == stats["spec_decode"]["num_draft_tokens"]
    finally:
        serve.delete("mixed")


def _deploy_tight(tiny_qwen, name: str, **limits) -> str:
    from deployments.app import build_app

    args = {"model": tiny_qwen, "served_model_name": "tiny", "speculation": {"method": "none"},
            "kv_cache_gib": 0.01, "max_model_len": 512, "max_num_seqs": 1, "replica_num_cpus": 0.1,
            "num_threads": 1, "warmup_profile": False, **limits}
    serve.run(build_app(args), name=name, route_prefix=f"/{name}")
    wait_ready(f"{_BASE[0]}/{name}")
    return f"{_BASE[0]}/{name}"


_BASE = [None]
LONG = {"model": "tiny", "prompt": "x", "max_tokens": 480, "ignore_eos": True, "stream": True}


async def _hold_streams(client, url: str, n: int):
    """Open n long streams. The ingress sends headers once the engine has accepted a request, so after each
    200 the request is in the engine (running or waiting)."""
    streams = []
    for _ in range(n):
        cm = client.stream("POST", f"{url}/v1/completions", json=LONG)
        assert (await cm.__aenter__()).status_code == 200
        streams.append(cm)
    return streams


def _send_while_holding(app: str, url: str, num_held: int, send):
    """Hold num_held streams open on the app, run send(client), release the streams; the app is deleted after."""
    async def main():
        async with httpx.AsyncClient(timeout=300) as client:
            held = await _hold_streams(client, url, num_held)
            try:
                return await send(client)
            finally:
                for cm in held:
                    await cm.__aexit__(None, None, None)

    try:
        return asyncio.run(main())
    finally:
        serve.delete(app)


def test_overload_429_when_the_engine_queue_is_full(ray_serve, tiny_qwen):
    _BASE[0] = ray_serve
    url = _deploy_tight(tiny_qwen, "tight429", max_waiting=1, max_ongoing_requests=8, max_queued_requests=8)
    # two held: one running, one waiting, the engine's bound
    r = _send_while_holding("tight429", url, 2, lambda client: client.post(
        f"{url}/v1/completions", json={"model": "tiny", "prompt": "y", "max_tokens": 4}))
    assert r.status_code == 429, r.text
    assert "replica overloaded: 2 requests in flight (limit 2)" in r.json()["error"]["message"]


def test_overload_503_when_serve_queue_is_full(ray_serve, tiny_qwen):
    _BASE[0] = ray_serve
    url = _deploy_tight(tiny_qwen, "tight503", max_waiting=8, max_ongoing_requests=1, max_queued_requests=1)
    # one held: the replica's one slot is taken
    responses = _send_while_holding("tight503", url, 1, lambda client: asyncio.gather(*(client.post(
        f"{url}/v1/completions", json={"model": "tiny", "prompt": "y", "max_tokens": 4}) for _ in range(6))))
    refused = [r for r in responses if r.status_code == 503]
    assert len(refused) >= 5 and all(r.status_code == 200 for r in responses if r.status_code != 503)  # 1 queued
    for r in refused:
        assert "server overloaded, request queue full" in r.json()["error"]["message"]


def _status_of(url: str, predicate, timeout: float = 60) -> dict:
    """The controller's status once predicate(status) holds (replicas report every controller_interval_s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = httpx.get(f"{url}/v1/smartspec/status", timeout=30).json()
        if predicate(status):
            return status
        time.sleep(0.2)
    raise TimeoutError(status)


def test_a_killed_replica_loses_no_request(ray_serve, tiny_qwen, reference):
    """Two replicas of one running slot each, each busy with a long stream; a greedy request waits behind one of
    them. That replica is killed (SIGKILL): its stream, which has sent tokens, ends with an error event; the
    waiting request, which has not, is answered by the other replica, equal to the offline engine's answer."""
    import signal

    _BASE[0] = ray_serve
    url = _deploy_tight(tiny_qwen, "failover", num_replicas=2, controller_interval_s=0.2)
    long = {**LONG, "max_tokens": 500}

    async def main():
        async with httpx.AsyncClient(timeout=300) as client:
            streams = []
            for _ in range(2):  # the router sends the second to the idle replica
                cm = client.stream("POST", f"{url}/v1/completions", json=long)
                response = await cm.__aenter__()
                lines = response.aiter_lines()
                while not (await anext(lines)).startswith("data: {"):
                    pass  # a token has been sent
                streams.append((cm, lines))
            waiting = asyncio.create_task(client.post(f"{url}/v1/completions", json={
                "model": "tiny", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "ignore_eos": True}))
            status = await asyncio.to_thread(_status_of, url, lambda s: len(s["replicas"]) == 2 and sorted(
                r["in_flight"] for r in s["replicas"].values()) == [1, 2])
            victim = next(r for r in status["replicas"].values() if r["in_flight"] == 2)
            os.kill(victim["pid"], signal.SIGKILL)
            ends = []
            for cm, lines in streams:
                rest = [line async for line in lines if line.startswith("data: ")]
                ends.append(rest[-2:])
                await cm.__aexit__(None, None, None)
            answer = await waiting
            return answer, ends, (await client.get(f"{url}/metrics")).text

    try:
        answer, ends, metrics = asyncio.run(main())
    finally:
        serve.delete("failover")
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == reference(PROMPTS[0], 8)
    assert answer.json()["usage"]["completion_tokens"] == 8  # billed once
    assert all(end[-1] == "data: [DONE]" for end in ends)
    errored = [end for end in ends if '"error"' in end[0]]
    finished = [end for end in ends if '"finish_reason": "length"' in end[0] or '"finish_reason":"length"' in end[0]]
    assert len(errored) == 1 and len(finished) == 1, ends
    assert re.search(r"smartspec_failover_retries_total 1\.0", metrics), metrics
    assert re.search(r'smartspec_routing_decisions_total\{reason="retry",replica="\w+"\} 1\.0', metrics), metrics


def _greedy_unary() -> list[dict]:
    """Two greedy unary requests of 64 tokens (the offline reference answers them)."""
    return [{"model": "tiny", "prompt": p, "max_tokens": 64, "temperature": 0, "ignore_eos": True}
            for p in PROMPTS[1:3]]


async def _stream_lines(client, url: str, body: dict) -> list[str]:
    """A stream's data lines, from its headers to its end."""
    async with client.stream("POST", url, json=body) as response:
        assert response.status_code == 200
        return [line async for line in response.aiter_lines() if line.startswith("data: ")]


async def _long_greedy_stream(client, url: str, opened: asyncio.Event) -> list[str]:
    """A greedy stream of LONG's tokens: its data lines; `opened` set once its headers came."""
    async with client.stream("POST", f"{url}/v1/completions", json={**LONG, "temperature": 0}) as response:
        assert response.status_code == 200
        opened.set()
        return [line async for line in response.aiter_lines() if line.startswith("data: ")]


def test_the_only_replica_killed_every_request_ends_answered_or_named(ray_serve, tiny_qwen, reference):
    """One replica running one stream, with a second stream and two greedy unary requests waiting in its engine;
    it is killed (SIGKILL) and Serve restarts it. The stream that sent tokens ends with an error event; each of the
    others is retried and either answered as the offline engine answers it, or, if no replica took it within
    replica_wait_s, refused with a named 503 and Retry-After (a stream: its error event). Nothing goes silent."""
    import signal

    _BASE[0] = ray_serve
    wait_s = 30
    url = _deploy_tight(tiny_qwen, "restart", controller_interval_s=0.2, replica_wait_s=wait_s)
    unary = _greedy_unary()

    async def main():
        async with httpx.AsyncClient(timeout=wait_s + 120) as client:
            tasks = []
            for _ in range(2):
                opened = asyncio.Event()
                tasks.append(asyncio.create_task(_long_greedy_stream(client, url, opened)))
                await opened.wait()
            tasks += [asyncio.create_task(client.post(f"{url}/v1/completions", json=body)) for body in unary]
            status = await asyncio.to_thread(_status_of, url, lambda s: [r["in_flight"] for r in s["replicas"].values()]
                                             == [4])
            start = time.monotonic()
            os.kill(next(iter(status["replicas"].values()))["pid"], signal.SIGKILL)
            results = await asyncio.gather(*tasks)
            return results, time.monotonic() - start

    try:
        (first, second, *answers), seconds = asyncio.run(main())
    finally:
        serve.delete("restart")
    assert seconds < wait_s + 110
    assert first[-1] == "data: [DONE]" and '"error"' in first[-2]  # it had sent tokens: its error, as before
    for events in (first, second):
        assert events[-1] == "data: [DONE]"
    named = 'no replica took the request within 30 s'
    if named not in second[-2]:  # retried and answered whole: the tokens an undisturbed run gives
        chunks = [json.loads(line[6:]) for line in second[:-1]]
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == reference("x", LONG["max_tokens"])
    for body, answer in zip(unary, answers):
        if answer.status_code == 200:
            assert answer.json()["choices"][0]["text"] == reference(body["prompt"], 64)
        else:
            assert answer.status_code == 503 and answer.headers["retry-after"] == "30", answer.text
            assert named in answer.json()["error"]["message"]


def test_a_replica_restarted_under_load_speculates_within_its_first_200_steps(ray_serve, tiny_qwen):
    """A restart must not leave the goodput policy at k = 0 (a warm-up profile taken under load, a draft price
    never measured again). The only replica, prompt lookup under the goodput policy with its warm-up profile, serves
    four greedy requests at a time whose answers repeat what they have seen; it is killed (SIGKILL) in the middle of
    that load and Serve starts it again, under the load still coming. The new replica's own step totals show steps
    that drafted among its first 200."""
    import signal

    _BASE[0] = ray_serve
    url = _deploy_tight(tiny_qwen, "restarted", max_num_seqs=4, warmup_profile=True, controller_interval_s=0.2,
                        speculation={"method": "ngram", "num_speculative_tokens": 4, "policy": "smartspec"})
    body = {"model": "tiny", "prompt": "abcabcabc abcabcabc abc", "max_tokens": 40, "temperature": 0,
            "ignore_eos": True}

    async def load(requests: int) -> list:
        slots = asyncio.Semaphore(4)
        async with httpx.AsyncClient(timeout=300) as client:
            async def one():
                async with slots:
                    try:
                        return (await client.post(f"{url}/v1/completions", json=body)).status_code
                    except httpx.HTTPError as e:
                        return repr(e)
            return await asyncio.gather(*(one() for _ in range(requests)))

    async def load_until(killed: asyncio.Event) -> None:
        """Four clients sending request after request until the replica is killed: in flight whenever it is
        looked at, however fast the replica serves."""
        async with httpx.AsyncClient(timeout=300) as client:
            async def client_loop():
                while not killed.is_set():
                    try:
                        await client.post(f"{url}/v1/completions", json=body)
                    except httpx.HTTPError:
                        pass
            await asyncio.gather(*(client_loop() for _ in range(4)))

    async def main():
        first = await asyncio.to_thread(_status_of, url, lambda s: len(s["replicas"]) == 1)
        (old,) = first["replicas"].values()
        killed = asyncio.Event()
        before = asyncio.create_task(load_until(killed))
        await asyncio.to_thread(_status_of, url, lambda s: any(r["in_flight"] for r in s["replicas"].values()))
        os.kill(old["pid"], signal.SIGKILL)
        killed.set()
        after = asyncio.create_task(load(8))  # the load goes on while Serve starts the replica again
        new = await asyncio.to_thread(_status_of, url, lambda s: [r["pid"] for r in s["replicas"].values()] not in (
            [], [old["pid"]]), 120)
        await before
        await after
        return old["pid"], await asyncio.to_thread(_status_of, url, lambda s: all(
            r["pid"] != old["pid"] and r["in_flight"] == 0 for r in s["replicas"].values()), 60), new

    try:
        old_pid, status, _ = asyncio.run(main())
    finally:
        serve.delete("restarted")
    (replica,) = status["replicas"].values()
    steps = replica["steps"]
    assert replica["pid"] != old_pid and steps["steps"] > 0
    drafted = sum(n for k, n in steps["chosen_k"].items() if int(k) > 0)
    assert steps["steps"] <= 200 and drafted > 0, steps


def _ingress_pid(app_name: str) -> int:
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(f"SERVE_REPLICA::{app_name}#OpenAIIngress#")]
    assert len(names) == 1, names
    return ray.get(ray.get_actor(names[0], namespace="serve").__ray_call__.remote(lambda self: os.getpid()))


def test_a_killed_ingress_replica_loses_no_request(ray_serve, tiny_qwen, reference):
    """One stream running, and a second stream and two greedy unary requests waiting in the only LLMServer; the
    only OpenAIIngress replica, which holds all four, is killed (SIGKILL). The proxy guard
    (deployments/http/proxy_guard.py, set by conftest as the README sets it) ends the running stream, which had
    sent tokens, with an error event and [DONE]; it sends the waiting stream (its headers alone sent) and each unary
    request again: Serve restarts the ingress and they are answered as the offline engine answers them, the
    stream into the response its client holds. Then every KV block is free again."""
    import signal

    _BASE[0] = ray_serve
    url = _deploy_tight(tiny_qwen, "ingress", controller_interval_s=0.2, orphan_check_s=0.05)
    unary = _greedy_unary()

    async def main():
        async with httpx.AsyncClient(timeout=180) as client:
            opened = asyncio.Event()
            tasks = [asyncio.create_task(_long_greedy_stream(client, url, opened))]
            await opened.wait()
            await asyncio.to_thread(_status_of, url, lambda s: [r["in_flight"] for r in s["replicas"].values()] == [1])
            waiting = {**unary[0], "stream": True}
            tasks.append(asyncio.create_task(_stream_lines(client, f"{url}/v1/completions", waiting)))
            tasks += [asyncio.create_task(client.post(f"{url}/v1/completions", json=body)) for body in unary]
            await asyncio.to_thread(_status_of, url, lambda s: [r["in_flight"] for r in s["replicas"].values()] == [4])
            os.kill(await asyncio.to_thread(_ingress_pid, "ingress"), signal.SIGKILL)
            return await asyncio.gather(*tasks)

    try:
        events, waited, *answers = asyncio.run(main())
        idle = _status_of(url, lambda s: all(r["in_flight"] == 0 and r["free_blocks"] == r["total_blocks"]
                                             for r in s["replicas"].values()), timeout=120)
    finally:
        serve.delete("ingress")
    assert events[-1] == "data: [DONE]" and "HTTP front failed" in events[-2], events[-3:]
    assert waited[-1] == "data: [DONE]" and '"error"' not in "".join(waited), waited[-3:]
    assert "".join(json.loads(line[6:])["choices"][0]["text"] for line in waited[:-1]
                   if json.loads(line[6:])["choices"]) == reference(unary[0]["prompt"], 64)
    for body, answer in zip(unary, answers):
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == reference(body["prompt"], 64)
    # the dead ingress's four generations were aborted as orphans; each answer had one generation run to its end
    (generations,) = [r["generations"] for r in idle["replicas"].values()]
    assert generations == {"submitted": 4 + 1 + len(unary), "completed": 1 + len(unary), "orphans_aborted": 4}, \
        generations


def test_a_hundred_fuzzed_requests_get_no_5xx_and_free_every_block(app):
    """scripts/fuzz_api.py's requests (every field, wrong types, odd unicode, huge and nested values, hang-ups),
    over HTTP and the Serve handle: no 5xx, no hang, every 4xx named, and afterwards the server is healthy with
    every KV block free."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from fuzz_api import FuzzRun, FuzzTarget, fuzz

    tally, back = fuzz(FuzzTarget(app, "tiny", serve.get_app_handle("main")), FuzzRun(100, timeout=120, progress=False))
    assert tally.requests == 100 and tally.by_status.get("200", 0) > 0
    assert (tally.server_errors, tally.hangs, tally.unnamed) == (0, 0, 0), tally.failures[:3]
    assert back


def test_the_paced_application_streams_without_a_model(ray_serve):
    """deployments.app:build_paced_app, what scripts/bench_serving_path.py deploys: the replica over an engine
    that emits a token a step, streamed as chat chunks; its steps' own time reported; a bad interval refused."""
    from deployments.app import build_paced_app

    with pytest.raises(ValueError, match="paced_step_s"):
        build_paced_app({"paced_step_s": 0})
    serve.run(build_paced_app({"paced_step_s": 0.002, "max_num_seqs": 4, "max_model_len": 512,
                               "replica_num_cpus": 0.1}), name="paced", route_prefix="/paced")
    url = f"{ray_serve}/paced"
    wait_ready(url)
    try:
        def stream(max_tokens: int) -> tuple[str, str]:
            body = {"model": "paced", "messages": [{"role": "user", "content": "go"}], "max_tokens": max_tokens,
                    "stream": True}
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
                assert r.status_code == 200
                chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
            text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
            return text, [c for c in chunks if c["choices"]][-1]["choices"][0]["finish_reason"]

        assert stream(12) == ("the quick br", "length")
        # four at once: their deltas come back by the ingress's channel to the replica (the goodput router sends
        # it there), several a message
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(stream, [150, 160, 170, 180]))
        assert answers == [(("the quick brown fox jumps over the lazy dog " * 5)[:n], "length")
                           for n in [150, 160, 170, 180]]
        stats = serve.get_deployment_handle("LLMServer", "paced").stats.remote().result(timeout_s=30)
        assert stats["steps"]["generated_tokens"] >= 12 + 660 and stats["steps"]["busy_s"] > 0
        channels = stats["channels"]
        assert channels["deltas"] + channels["direct"] >= 660 and channels["deltas"] >= 2 * channels["batches"] > 0
    finally:
        serve.delete("paced")
