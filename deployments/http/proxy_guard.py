"""Serve's HTTP proxy, guarded: a request whose ingress replica dies under it is sent again, or ended by name.

Serve's proxy answers a request whose OpenAIIngress replica died (kill -9, its node gone) with a bare
`500 Internal Server Error`, and cuts a stream that had begun without an end. The ingress holds no state a request
needs (the replicas hold the generations, and their failover is the ingress's), so a request that had no answer
yet can simply be sent again: Serve routes it to a live ingress replica, or holds it until one is back. This ASGI
middleware runs inside each proxy, through Serve's proxy callback:

    RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=deployments.http.proxy_guard:middlewares

set where Ray starts (`serve run` or `ray start`; the KubeRay manifests set it on every pod). For each request it
keeps the body; when the proxy ends a request without a response (what it does for an ingress replica's death), it
sends it again, with growing pauses, for at most `SMARTSPEC_PROXY_RETRY_S` seconds (60), then answers a named 503
with `Retry-After`. A stream that had sent its headers ends with an error event and `[DONE]`, as a stream whose
generation failed does. A client that hung up is never retried. Responses the proxy itself makes (408, 429, 503)
pass unchanged. Imports only the error shapes: it runs in the proxy, beside no model."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time

from deployments.http import answers

logger = logging.getLogger("ray.serve")

RETRY_ENV = "SMARTSPEC_PROXY_RETRY_S"
MAX_KEPT_BODY = 64 << 20  # a larger body passes unguarded rather than held twice in the proxy


class IngressReplay:
    """Pure ASGI middleware (Starlette's `Middleware(IngressReplay)`): replays a request the proxy left unanswered."""

    def __init__(self, app, retry_s: float = 60.0, first_pause_s: float = 0.25):
        if retry_s < 0 or first_pause_s <= 0:
            raise ValueError("retry_s must be >= 0 and first_pause_s > 0")
        self.app, self.retry_s, self.first_pause_s = app, retry_s, first_pause_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        body, kept, client_gone = await read_body(receive)
        if not kept or client_gone:  # unguarded: what was read is given once, then the rest as it comes
            return await self.app(scope, replay(body, receive, []), send)
        gone: list[bool] = []
        deadline, pause, attempt = None, self.first_pause_s, 0
        while True:
            attempt += 1
            sent = SentResponse(send)
            try:
                await self.app(dict(scope, headers=list(scope.get("headers", []))), replay(body, receive, gone),
                               sent.send)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the proxy turns a replica's death into no response; a raise means the same
                logger.warning("proxy guard: attempt %d of %s raised %r", attempt, scope.get("path"), exc)
            if sent.finished or gone:
                return
            if sent.started:
                return await sent.end_stream()
            deadline = deadline or time.monotonic() + self.retry_s
            if time.monotonic() + pause > deadline:
                return await refuse(send, self.retry_s)
            logger.warning("proxy guard: %s %s had no answer (its ingress replica failed?); sending it again",
                           scope.get("method"), scope.get("path"))
            await asyncio.sleep(pause)
            pause = min(pause * 2, 4.0)


async def read_body(receive) -> tuple[list[dict], bool, bool]:
    """The request's body messages as read, whether they are the whole body (kept, to send again: not past
    MAX_KEPT_BODY), and whether the client hung up while it was read."""
    messages, size = [], 0
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] == "http.disconnect":
            return messages, False, True
        size += len(message.get("body", b""))
        if size > MAX_KEPT_BODY:
            return messages, False, False
        if not message.get("more_body", False):
            return messages, True, False


def replay(messages: list[dict], receive, gone: list[bool]):
    """A receive that gives the kept body again, then waits on the client (noting a hang-up in `gone`)."""
    queue = list(messages)

    async def receive_again():
        if queue:
            return queue.pop(0)
        message = await receive()
        if message["type"] == "http.disconnect":
            gone.append(True)
        return message
    return receive_again


class SentResponse:
    """What one attempt sent: whether its response started and finished, and whether it is an event stream."""

    def __init__(self, send):
        self._send, self.started, self.finished, self.event_stream = send, False, False, False

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            self.event_stream = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                    for k, v in message.get("headers", []))
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.finished = True
        await self._send(message)

    async def end_stream(self) -> None:
        """The response began and its ingress replica died: end it whole, a stream with its error event."""
        tail = b""
        if self.event_stream:
            error = answers.error_body(500, "the server's HTTP front failed during this stream (its ingress replica "
                                            "died); the answer is incomplete")
            tail = (answers.sse(error) + answers.sse("[DONE]")).encode()
        await self._send({"type": "http.response.body", "body": tail, "more_body": False})


async def refuse(send, retry_s: float) -> None:
    body = answers.error_body(503, f"no ingress replica answered within {retry_s:g} s of retries "
                                   f"({RETRY_ENV}); the request was not served")
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                            (b"retry-after", str(max(1, round(retry_s))).encode())]})
    await send({"type": "http.response.body", "body": payload, "more_body": False})


def middlewares() -> list:
    """Serve's proxy callback: the guard, with its retry budget from SMARTSPEC_PROXY_RETRY_S."""
    from starlette.middleware import Middleware

    raw = os.environ.get(RETRY_ENV, "60")
    try:
        retry_s = float(raw)
    except ValueError:
        raise ValueError(f"{RETRY_ENV} must be a number of seconds, got {raw!r}") from None
    return [Middleware(IngressReplay, retry_s=retry_s)]
