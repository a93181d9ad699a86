"""The proxy guard (deployments/http/proxy_guard.py) around an app that behaves as Serve's proxy does: a replica's
death is a return without a response (a bare 500 from uvicorn), or a stream cut after its headers."""
import asyncio
import json

import httpx
import pytest

from deployments.http.proxy_guard import IngressReplay, middlewares


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


def post(app, stream: bool = False) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.post("/v1/completions", json={"prompt": "hi", "stream": stream})
    return asyncio.run(go())


def test_a_request_left_unanswered_is_sent_again_with_its_body():
    inner = ProxyStandIn(fail=2)
    response = post(IngressReplay(inner, retry_s=5, first_pause_s=0.01))
    assert response.status_code == 200 and inner.calls == 3
    assert len(set(inner.bodies)) == 1 and json.loads(inner.bodies[0]) == {"prompt": "hi", "stream": False}
    assert json.loads(response.json()["echo"]) == {"prompt": "hi", "stream": False}


def test_past_its_retry_budget_it_is_refused_by_name_with_retry_after():
    inner = ProxyStandIn(fail=10 ** 6)
    response = post(IngressReplay(inner, retry_s=0.2, first_pause_s=0.05))
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    error = response.json()["error"]
    assert error["code"] == 503 and "no ingress replica answered" in error["message"]
    assert 2 <= inner.calls <= 6


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


def test_the_callback_reads_its_budget_and_names_a_bad_one(monkeypatch):
    monkeypatch.setenv("SMARTSPEC_PROXY_RETRY_S", "12")
    (middleware,) = middlewares()
    assert middleware.cls is IngressReplay and middleware.kwargs == {"retry_s": 12.0}
    monkeypatch.setenv("SMARTSPEC_PROXY_RETRY_S", "soon")
    with pytest.raises(ValueError, match="SMARTSPEC_PROXY_RETRY_S"):
        middlewares()


def test_a_body_too_large_to_keep_reaches_the_app_whole_once(monkeypatch):
    from deployments.http import proxy_guard

    monkeypatch.setattr(proxy_guard, "MAX_KEPT_BODY", 4)
    inner = ProxyStandIn(fail=1)
    parts = [{"type": "http.request", "body": b'{"prompt": ', "more_body": True},
             {"type": "http.request", "body": b'"hi"}', "more_body": False}]

    async def receive():
        return parts.pop(0) if parts else await asyncio.Future()

    async def send(message):
        raise AssertionError(f"nothing is sent for a request the proxy left unanswered: {message}")
    guard = IngressReplay(inner, retry_s=5, first_pause_s=0.01)
    asyncio.run(guard({"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}, receive, send))
    assert inner.calls == 1 and inner.bodies == [b'{"prompt": "hi"}']  # unguarded: not sent again
