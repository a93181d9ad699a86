"""Serve's HTTP proxy, guarded: a request is checked before its body is read, and one whose ingress replica dies
under it is sent again, or ended by name.

Serve's proxy answers a request whose OpenAIIngress replica died (kill -9, its node gone) with a bare
`500 Internal Server Error`, and cuts a stream that had begun without an end. The ingress holds no state a request
needs (the replicas hold the generations, and their failover is the ingress's), so a request that had no answer
yet can simply be sent again: Serve routes it to a live ingress replica, or holds it until one is back. This ASGI
middleware runs inside each proxy, through Serve's proxy callback:

    RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=deployments.http.proxy_guard:middlewares

set where Ray starts (`serve run` or `ray start`; the KubeRay manifests set it on every pod). It guards this
application's generation routes alone (POST .../v1/completions and .../v1/chat/completions); every other request
passes through untouched. For a guarded request, in order:
- the API key: where one is known for the request's route (each ingress publishes its application's route prefix
  with its key's digest, or none, to the cluster; for a route no ingress published, SMARTSPEC_API_KEY in the
  proxy's environment), a request without a matching `Authorization: Bearer` header gets its 401 before a byte of
  its body is read;
- the body's size: over SMARTSPEC_MAX_BODY_MIB (8) MiB, a 413, from its Content-Length before reading, else as soon
  as the bytes read pass the cap (nothing more is buffered);
- the body is kept; when the proxy ends the request without a response (what it does for an ingress replica's
  death), it is sent again, with growing pauses, at most MAX_REPLAYS times within SMARTSPEC_PROXY_RETRY_S seconds
  (60), then answered by a named 503 with `Retry-After`. A request whose ingress replica died twice while it held
  the request (the body had been read) is not sent to a third: a named 503, for the request that may be what kills
  them.
A stream that had sent its headers alone (the ingress holds a stream's first chunk until its first token) is sent
again into the same response; one that had sent more ends with an error event and `[DONE]`, as a stream whose
generation failed does.
A client that hung up is never retried. Responses the proxy itself makes (408, 429, 503) pass unchanged. Imports
only the error shapes: it runs in the proxy, beside no model."""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import time
from collections.abc import Callable

from deployments.http import answers

logger = logging.getLogger("ray.serve")

RETRY_ENV, MAX_BODY_ENV, KEY_ENV = "SMARTSPEC_PROXY_RETRY_S", "SMARTSPEC_MAX_BODY_MIB", "SMARTSPEC_API_KEY"
GUARDED_PATHS = ("/v1/completions", "/v1/chat/completions")
MAX_REPLAYS = 3  # sends after the first, for a request the proxy left unanswered
MAX_INGRESS_DEATHS = 2  # ingress replicas that died holding one request before it is refused
KEY_DIGESTS_KV = "smartspec/api-key/"  # + app name: {"prefix", "digest" ("" for none), "at"}, from its ingress


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class IngressReplay:
    """Pure ASGI middleware (Starlette's `Middleware(IngressReplay)`): checks a request before reading its body,
    and replays one the proxy left unanswered. known_keys(path): the digests of the API keys in force for a route
    (none: no key)."""

    def __init__(self, app, retry_s: float = 60.0, first_pause_s: float = 0.25, max_body_bytes: int = 8 << 20,
                 known_keys: Callable[[str], set[str]] = lambda path: set()):
        if retry_s < 0 or first_pause_s <= 0 or max_body_bytes < 1:
            raise ValueError("retry_s must be >= 0, first_pause_s > 0 and max_body_bytes >= 1")
        self.app, self.retry_s, self.first_pause_s = app, retry_s, first_pause_s
        self.max_body_bytes, self.known_keys = max_body_bytes, known_keys

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or \
                not scope.get("path", "").rstrip("/").endswith(GUARDED_PATHS):
            return await self.app(scope, receive, send)
        if (refusal := self.refused_before_body(scope)) is not None:
            return await answer(send, *refusal)
        body, whole, client_gone = await read_body(receive, self.max_body_bytes)
        if not whole and not client_gone:
            return await answer(send, *self.too_large())
        if client_gone:  # what was read is given once
            return await self.app(scope, replay(body, receive, [], []), send)
        await self.serve_with_replays(scope, body, receive, send)

    def refused_before_body(self, scope) -> tuple[int, str, dict[str, str], str | None] | None:
        """A 401 (no matching key) or a 413 (a Content-Length over the cap), decided from the headers alone."""
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        digests = self.known_keys(scope.get("path", ""))
        if digests:
            scheme, _, token = headers.get("authorization", "").partition(" ")
            given = key_digest(token.strip()) if scheme.lower() == "bearer" else ""
            if not any(hmac.compare_digest(given, d) for d in digests):
                return 401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'", \
                    {"www-authenticate": "Bearer"}, "authorization"
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return self.too_large()
        return None

    def too_large(self) -> tuple[int, str, dict[str, str], str | None]:
        return 413, f"request body over {self.max_body_bytes} bytes ({MAX_BODY_ENV}); it was not read", {}, None

    async def serve_with_replays(self, scope, body: list[dict], receive, send) -> None:
        gone: list[bool] = []
        deadline, pause, deaths = time.monotonic() + self.retry_s, self.first_pause_s, 0
        sent = SentResponse(send)
        for attempt in range(1, MAX_REPLAYS + 2):
            delivered: list[bool] = []
            sent.next_attempt()
            try:
                await self.app(dict(scope, headers=list(scope.get("headers", []))),
                               replay(body, receive, gone, delivered), sent.send)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the proxy turns a replica's death into no response; a raise means the same
                logger.warning("proxy guard: attempt %d of %s raised %r", attempt, scope.get("path"), exc)
            if sent.finished or gone:
                return
            if sent.body_sent or (sent.started and not sent.event_stream):
                return await sent.end_stream()
            deaths += bool(delivered)  # its ingress had read the request, then answered nothing: it died
            if deaths >= MAX_INGRESS_DEATHS:
                return await sent.refuse(503, f"this request's ingress replica failed {deaths} times while holding "
                                              f"it; it was not sent to another", {"retry-after": "1"})
            if attempt > MAX_REPLAYS or time.monotonic() + pause > deadline:
                break
            logger.warning("proxy guard: %s %s had no answer (its ingress replica failed?); sending it again",
                           scope.get("method"), scope.get("path"))
            await asyncio.sleep(pause)
            pause = min(pause * 2, 4.0)
        await sent.refuse(503, f"no ingress replica answered within {self.retry_s:g} s and {MAX_REPLAYS} resends "
                               f"({RETRY_ENV}); the request was not served",
                          {"retry-after": str(max(1, round(self.retry_s)))})


async def read_body(receive, cap: int) -> tuple[list[dict], bool, bool]:
    """The request's body messages as read, whether they are the whole body (False: it passed `cap` bytes, and
    reading stopped there), and whether the client hung up while it was read."""
    messages, size = [], 0
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] == "http.disconnect":
            return messages, False, True
        size += len(message.get("body", b""))
        if size > cap:
            return messages, False, False
        if not message.get("more_body", False):
            return messages, True, False


def replay(messages: list[dict], receive, gone: list[bool], delivered: list[bool]):
    """A receive that gives the kept body again (noting in `delivered` that the last of it was taken), then waits
    on the client (noting a hang-up in `gone`)."""
    queue = list(messages)

    async def receive_again():
        if queue:
            message = queue.pop(0)
            if not queue:
                delivered.append(True)
            return message
        message = await receive()
        if message["type"] == "http.disconnect":
            gone.append(True)
        return message
    return receive_again


class SentResponse:
    """What the attempts sent the client: whether the response started and finished, whether it is an event stream,
    and whether any of its body went out. An event stream whose headers alone went out (the ingress holds a
    stream's first chunk until its first token) is sent again into the same response: the next attempt's start is
    not sent again, and an error it answers with instead of a stream goes out as the stream's error event."""

    def __init__(self, send):
        self._send, self.started, self.finished, self.event_stream, self.body_sent = send, False, False, False, False
        self._spliced = False  # this attempt's start was held back: the client has the first attempt's
        self._refused: tuple[int, bytes] | None = None  # a spliced attempt that answered an error, not a stream

    def next_attempt(self) -> None:
        self._spliced, self._refused = self.started, None

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            event_stream = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                               for k, v in message.get("headers", []))
            if self._spliced:
                if message.get("status") != 200 or not event_stream:
                    self._refused = (message.get("status", 500), b"")
                return
            self.started, self.event_stream = True, event_stream
        elif message["type"] == "http.response.body":
            last = not message.get("more_body", False)
            if self._refused is not None:  # an error answer in a spliced attempt: collected, sent as an event
                self._refused = (self._refused[0], self._refused[1] + message.get("body", b""))
                if last:
                    await self._end_with(*self._refused)
                return
            self.body_sent |= bool(message.get("body"))
            self.finished |= last
        await self._send(message)

    async def refuse(self, status: int, message: str, headers: dict[str, str]) -> None:
        """The guard's own refusal: an error response, or, where a stream's headers went out already, its error
        event and [DONE]."""
        if not self.started:
            return await answer(self._send, status, message, headers)
        await self._end_with(status, json.dumps(answers.error_body(status, message)).encode())

    async def _end_with(self, status: int, body: bytes) -> None:
        """A spliced attempt's error answer, as the stream's error event and [DONE]."""
        try:
            error = json.loads(body)
        except ValueError:
            error = answers.error_body(status, body.decode("utf-8", "replace")[:200] or "the request failed")
        self.finished = True
        await self._send({"type": "http.response.body", "body": (answers.sse(error) + answers.sse("[DONE]")).encode(),
                          "more_body": False})

    async def end_stream(self) -> None:
        """The response began and its ingress replica died: end it whole, a stream with its error event."""
        tail = b""
        if self.event_stream:
            error = answers.error_body(500, "the server's HTTP front failed during this stream (its ingress replica "
                                            "died); the answer is incomplete")
            tail = (answers.sse(error) + answers.sse("[DONE]")).encode()
        await self._send({"type": "http.response.body", "body": tail, "more_body": False})


async def answer(send, status: int, message: str, headers: dict[str, str], param: str | None = None) -> None:
    """An error response in the API's shape, sent by the guard itself; param: the field to blame."""
    payload = json.dumps(answers.error_body(status, message, param)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                            *((k.encode(), v.encode()) for k, v in headers.items())]})
    await send({"type": "http.response.body", "body": payload, "more_body": False})


class PublishedKeys:
    """The API keys in force per route, as digests: what the ingress replicas of this cluster published for their
    applications' route prefixes (ingress.publish_key; the longest prefix of a path wins, then the latest), read
    from Ray's key-value store at most every ttl_s; for a route none published, SMARTSPEC_API_KEY where this proxy
    runs."""

    def __init__(self, ttl_s: float = 5.0) -> None:
        own = os.environ.get(KEY_ENV)
        self.own = {key_digest(own)} if own else set()
        self.ttl_s, self.read_at, self.published = ttl_s, -float("inf"), []

    def __call__(self, path: str) -> set[str]:
        if time.monotonic() - self.read_at > self.ttl_s:
            self.read_at = time.monotonic()
            try:
                self.published = read_published()
            except Exception as exc:  # Ray's store away: the keys last read stay
                logger.warning("proxy guard: could not read the published API keys: %r", exc)
        return keys_for(path, self.published, self.own)


def keys_for(path: str, published: list[dict], fallback: set[str]) -> set[str]:
    """The digests in force for a path: the published entry of the longest route prefix that holds it (the latest
    of equals), else the fallback."""
    def holds(prefix: str) -> bool:
        return prefix == "/" or path == prefix or path.startswith(prefix.rstrip("/") + "/")
    entries = [e for e in published if isinstance(e.get("prefix"), str) and holds(e["prefix"])]
    if not entries:
        return fallback
    best = max(entries, key=lambda e: (len(e["prefix"]), e.get("at", 0)))
    return {best["digest"]} if best.get("digest") else set()


def read_published() -> list[dict]:
    import ray
    from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_list

    if not ray.is_initialized():
        return []
    values = (_internal_kv_get(k) for k in _internal_kv_list(KEY_DIGESTS_KV))
    return [json.loads(v) for v in values if v]


def middlewares() -> list:
    """Serve's proxy callback: the guard, with its retry budget (SMARTSPEC_PROXY_RETRY_S) and body cap
    (SMARTSPEC_MAX_BODY_MIB) from the environment."""
    from starlette.middleware import Middleware

    retry_s = _env_number(RETRY_ENV, 60.0)
    max_body_mib = _env_number(MAX_BODY_ENV, 8.0)
    if max_body_mib <= 0:
        raise ValueError(f"{MAX_BODY_ENV} must be a positive number of MiB, got {max_body_mib:g}")
    return [Middleware(IngressReplay, retry_s=retry_s, max_body_bytes=int(max_body_mib * 2**20),
                       known_keys=PublishedKeys())]


def _env_number(name: str, default: float) -> float:
    raw = os.environ.get(name, str(default))
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {raw!r}") from None
