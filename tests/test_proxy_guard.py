"""The proxy guard (deployments/http/proxy_guard.py) around an app that behaves as Serve's proxy does: a replica's
death is a return without a response (a bare 500 from uvicorn), or a stream cut after its headers."""
import asyncio
import json

import httpx
import pytest

from deployments.http.proxy_guard import MAX_REPLAYS, IngressReplay, key_digest, keys_for, middlewares


class ProxyStandIn:
    """An ASGI app that fails its first `fail` calls as the proxy does when the ingress replica dies, then answers
    with the request's body echoed; `stream` sends headers and one event before failing."""

    def __init__(self, fail: int, stream: bool = False, status: int = 200):
        self.fail, self.stream, self.status, self.calls, self.bodies = fail, stream, status, 0, []

    async def __call__(self, scope, receive, send):
        self.calls += 1
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.bodies.append(body)
        if self.stream:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
            await send({"type": "http.response.body", "body": b'data: {"x": 1}\n\n', "more_body": True})
        if self.calls <= self.fail:
            return
        if not self.stream:
            await send({"type": "http.response.start", "status": self.status,
                        "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"echo": ' + json.dumps(body.decode()).encode() + b"}"})


def post(app, stream: bool = False, path: str = "/v1/completions", headers: dict | None = None,
         content: bytes | None = None) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            if content is not None:
                return await client.post(path, content=content, headers=headers)
            return await client.post(path, json={"prompt": "hi", "stream": stream}, headers=headers)
    return asyncio.run(go())


def test_a_request_left_unanswered_is_sent_again_with_its_body():
    inner = ProxyStandIn(fail=1)
    response = post(IngressReplay(inner, retry_s=5, first_pause_s=0.01))
    assert response.status_code == 200 and inner.calls == 2
    assert len(set(inner.bodies)) == 1 and json.loads(inner.bodies[0]) == {"prompt": "hi", "stream": False}
    assert json.loads(response.json()["echo"]) == {"prompt": "hi", "stream": False}


class NeverDelivered(ProxyStandIn):
    """The proxy could not hand the request to any ingress replica: it returns without reading the body."""

    async def __call__(self, scope, receive, send):
        self.calls += 1


def test_past_its_retry_budget_it_is_refused_by_name_with_retry_after():
    inner = NeverDelivered(fail=10 ** 6)
    response = post(IngressReplay(inner, retry_s=0.2, first_pause_s=0.05))
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    error = response.json()["error"]
    assert error["code"] == 503 and "no ingress replica answered" in error["message"]
    assert 2 <= inner.calls <= 4


def test_it_sends_a_request_at_most_three_times_more():
    inner = NeverDelivered(fail=10 ** 6)
    response = post(IngressReplay(inner, retry_s=60, first_pause_s=0.001))
    assert response.status_code == 503 and inner.calls == 1 + MAX_REPLAYS == 4


def test_a_request_that_killed_two_ingress_replicas_is_not_sent_to_a_third():
    """Each attempt read the whole body and then answered nothing (its replica died holding it): after two, a
    named 503, however much retry budget is left."""
    inner = ProxyStandIn(fail=10 ** 6)
    response = post(IngressReplay(inner, retry_s=60, first_pause_s=0.001))
    assert response.status_code == 503 and inner.calls == 2
    assert "failed 2 times while holding it" in response.json()["error"]["message"]


def test_other_routes_and_methods_pass_through_untouched():
    """Another application's route, or a GET: no body kept, no replay, no key or size check of the guard's."""
    inner = ProxyStandIn(fail=0)
    guard = IngressReplay(inner, retry_s=5, first_pause_s=0.01, max_body_bytes=4, known_keys=lambda path: {"x"})
    response = post(guard, path="/other-app/predict")  # no key, a body over the cap: none of the guard's business
    assert response.status_code == 200 and inner.bodies == [b'{"prompt":"hi","stream":false}']
    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}
    asyncio.run(guard({"type": "http", "method": "GET", "path": "/v1/completions", "headers": []}, receive, send))
    assert sent[0]["status"] == 200 and inner.calls == 2


def test_a_missing_or_wrong_key_is_refused_before_the_body_is_read():
    read = []

    class Reads(ProxyStandIn):
        async def __call__(self, scope, receive, send):
            read.append(True)
            await super().__call__(scope, receive, send)
    guard = IngressReplay(Reads(fail=0), retry_s=5, first_pause_s=0.01, known_keys=lambda path: {key_digest("k1")})
    for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "Basic k1"}):
        response = post(guard, headers=headers)
        assert response.status_code == 401 and response.json()["error"]["code"] == 401
        assert response.headers["www-authenticate"] == "Bearer"
    assert read == []
    assert post(guard, headers={"authorization": "Bearer k1"}).status_code == 200 and read == [True]


def test_a_body_over_the_cap_gets_413_before_it_is_buffered():
    """By its Content-Length, before a byte is read; without one (chunked), as soon as the bytes read pass it."""
    inner = ProxyStandIn(fail=0)
    guard = IngressReplay(inner, retry_s=5, first_pause_s=0.01, max_body_bytes=64)
    response = post(guard, content=b"x" * 65, headers={"content-type": "application/json"})
    assert response.status_code == 413 and "over 64 bytes" in response.json()["error"]["message"]
    chunks = [{"type": "http.request", "body": b"y" * 40, "more_body": True} for _ in range(1000)]
    taken = []

    async def receive():
        taken.append(1)
        return chunks.pop()

    sent = []

    async def send(message):
        sent.append(message)
    asyncio.run(guard({"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}, receive,
                      send))
    assert sent[0]["status"] == 413 and len(taken) == 2 and inner.calls == 0
    assert post(guard, content=b"{}" * 10, headers={"content-type": "application/json"}).status_code == 200


def test_an_answer_the_proxy_made_itself_passes_unchanged():
    inner = ProxyStandIn(fail=0, status=503)
    response = post(IngressReplay(inner, retry_s=5, first_pause_s=0.01))
    assert response.status_code == 503 and inner.calls == 1


def test_a_stream_cut_after_its_headers_ends_with_an_error_event_and_done():
    inner = ProxyStandIn(fail=1, stream=True)
    response = post(IngressReplay(inner, retry_s=5, first_pause_s=0.01), stream=True)
    events = [line for line in response.text.splitlines() if line.startswith("data: ")]
    assert inner.calls == 1 and events[0] == 'data: {"x": 1}' and events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["error"]["code"] == 500 and "HTTP front failed" in events[-2]


class HeadersThenDies:
    """An ingress stand-in whose first `fail` calls start an event stream (headers alone) and die before its first
    token; then one answers `then`: a whole stream, or an error (status, JSON body)."""

    def __init__(self, fail: int, then: tuple[int, bytes] | None = None):
        self.fail, self.then, self.calls = fail, then, 0

    async def __call__(self, scope, receive, send):
        self.calls += 1
        while (await receive()).get("more_body"):
            pass
        if self.calls > self.fail and self.then is not None:
            status, body = self.then
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": body})
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
        if self.calls > self.fail:
            for event in (b'data: {"token": 1}\n\n', b"data: [DONE]\n\n"):
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b""})


def guarded_messages(inner) -> list[dict]:
    """What the guard sends the client for one streamed request, message by message."""
    sent, body = [], [{"type": "http.request", "body": b'{"stream": true}', "more_body": False}]

    async def receive():
        if body:
            return body.pop()
        await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)
    asyncio.run(IngressReplay(inner, retry_s=5, first_pause_s=0.001)(
        {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}, receive, send))
    return sent


def test_a_stream_whose_ingress_died_before_its_first_token_is_sent_again_into_the_same_response():
    """Its client had read the headers alone: the next attempt's events follow them, its start held back."""
    inner = HeadersThenDies(fail=1)
    sent = guarded_messages(inner)
    assert inner.calls == 2
    assert [m["type"] for m in sent].count("http.response.start") == 1 and sent[0]["status"] == 200
    assert b"".join(m.get("body", b"") for m in sent[1:]) == b'data: {"token": 1}\n\ndata: [DONE]\n\n'


def test_a_spliced_attempt_that_answers_an_error_ends_the_stream_with_its_event():
    """The next attempt answers a 503 instead of a stream: the client, holding a 200 event stream, reads that
    error as the stream's error event, then [DONE]."""
    refusal = json.dumps({"error": {"message": "no replica took the request within 60 s", "code": 503}}).encode()
    sent = guarded_messages(HeadersThenDies(fail=1, then=(503, refusal)))
    assert [m["type"] for m in sent].count("http.response.start") == 1 and sent[0]["status"] == 200
    events = b"".join(m.get("body", b"") for m in sent[1:]).decode().split("\n\n")
    assert json.loads(events[0][6:])["error"]["code"] == 503 and events[1] == "data: [DONE]"
    assert sent[-1]["more_body"] is False


def test_a_stream_whose_ingress_replicas_keep_dying_ends_with_a_named_error_event():
    """Headers sent, then two ingress replicas died holding it: the guard's 503 goes out as the stream's error
    event, after the headers the client has, not as a second response."""
    inner = HeadersThenDies(fail=10)
    sent = guarded_messages(inner)
    assert inner.calls == 2 and [m["type"] for m in sent].count("http.response.start") == 1
    events = b"".join(m.get("body", b"") for m in sent[1:]).decode().split("\n\n")
    assert json.loads(events[0][6:])["error"]["code"] == 503 and "failed 2 times" in events[0]
    assert events[1] == "data: [DONE]"


def test_a_client_that_hung_up_is_not_sent_again():
    inner = ProxyStandIn(fail=10)
    guard = IngressReplay(inner, retry_s=5, first_pause_s=0.01)
    messages = [{"type": "http.request", "body": b"{}", "more_body": False}, {"type": "http.disconnect"}]

    async def receive():
        return messages.pop(0) if messages else await asyncio.Future()

    class Drain:
        async def __call__(self, scope, receive, send):  # reads the body and then the hang-up, as the proxy does
            await receive()
            await receive()
            inner.calls += 1

    guard.app = Drain()
    sent = []

    async def send(message):
        sent.append(message)
    asyncio.run(guard({"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}, receive, send))
    assert inner.calls == 1 and sent == []


def test_the_callback_reads_its_budget_cap_and_key_and_names_a_bad_one(monkeypatch):
    monkeypatch.setenv("SMARTSPEC_PROXY_RETRY_S", "12")
    monkeypatch.setenv("SMARTSPEC_MAX_BODY_MIB", "0.5")
    monkeypatch.setenv("SMARTSPEC_API_KEY", "secret")
    (middleware,) = middlewares()
    assert middleware.cls is IngressReplay and middleware.kwargs["retry_s"] == 12.0
    assert middleware.kwargs["max_body_bytes"] == 1 << 19
    assert middleware.kwargs["known_keys"]("/v1/completions") == {key_digest("secret")}  # no Ray: the environment's
    monkeypatch.setenv("SMARTSPEC_PROXY_RETRY_S", "soon")
    with pytest.raises(ValueError, match="SMARTSPEC_PROXY_RETRY_S"):
        middlewares()


def test_the_key_in_force_is_the_published_one_of_the_longest_route_prefix():
    published = [{"prefix": "/", "digest": "", "at": 1}, {"prefix": "/keyed", "digest": "d1", "at": 1},
                 {"prefix": "/keyed", "digest": "d2", "at": 2}]
    assert keys_for("/v1/completions", published, {"env"}) == set()  # the root app has no key
    assert keys_for("/keyed/v1/completions", published, {"env"}) == {"d2"}  # the latest of the two
    assert keys_for("/keyedness/v1/completions", published, {"env"}) == set()  # not under /keyed
    assert keys_for("/x/v1/completions", [], {"env"}) == {"env"}  # nothing published: the environment's

