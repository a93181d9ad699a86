"""The OpenAI-compatible HTTP front (FastAPI through @serve.ingress): validation and status codes here, tokens
from the LLMServer replicas through a streaming handle."""

import asyncio
import hmac
import json
import os
import time
from contextlib import aclosing
from dataclasses import replace

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError
import ray
from ray import serve
from ray.serve.exceptions import BackPressureError

from deployments.control import metrics
from deployments.control.metrics import IngressMetrics, render_replica_metrics
from deployments.http import answers, proxy_guard
from deployments.http import protocol as proto
from deployments.http.answers import Endpoint
from deployments.http.channels import Channels
from deployments.http.fold import AnswerFold, GenerationFailedInServer
from deployments.http.tools import template_messages
from deployments.placement.failover import FailoverStream, NoReplicaInTime
from deployments.placement.latency import prefix_text
from deployments.wire import GenerateCall, Refused

api = FastAPI(title="SmartSpec", description="OpenAI-compatible LLM serving with goodput-chosen speculation")
SCHEMAS = {Endpoint.CHAT: proto.ChatCompletionRequest, Endpoint.COMPLETIONS: proto.CompletionRequest}


class HTTPError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.retry_after_s = status, message, param, retry_after_s

    @staticmethod
    def no_replica(exc: NoReplicaInTime) -> "HTTPError":
        return HTTPError(503, str(exc), retry_after_s=exc.retry_after_s)

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else None
        return JSONResponse(answers.error_body(self.status, self.message, self.param), status_code=self.status,
                            headers=headers)


async def publish_key(api_key: str | None, attempts: int = 30) -> None:
    """Tell the proxies' guards (proxy_guard.PublishedKeys) this application's route prefix and API key, as a
    digest ("" for none), so that they refuse a request without it before reading its body, and no key of another
    application holds its routes. The route prefix comes from Serve's controller, once the application is known
    there (retried a second apart)."""
    try:
        context = serve.get_replica_context()
    except Exception:  # not inside a Serve replica (a test that builds the class): no proxy to tell
        return
    from ray.experimental.internal_kv import _internal_kv_put
    from ray.serve.context import _get_global_client

    for _ in range(attempts):
        try:
            details = await _get_global_client()._controller.get_serve_instance_details.remote()
            prefix = details["applications"][context.app_name]["route_prefix"]
            break
        except Exception:  # Serve's private API: where it differs or is not ready, the ingress checks alone
            await asyncio.sleep(1)
    else:
        return
    entry = {"prefix": prefix, "digest": proxy_guard.key_digest(api_key) if api_key else "", "at": time.time()}
    _internal_kv_put(proxy_guard.KEY_DIGESTS_KV + context.app_name, json.dumps(entry).encode(), overwrite=True)


def _error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return HTTPError(status, message, param).response()


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0]
    loc = ".".join(str(p) for p in first["loc"])
    extra = f" ({len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
    return f"{loc}: {first['msg']}{extra}", loc or None


@serve.deployment(name="OpenAIIngress", ray_actor_options={"num_cpus": 0.1}, max_ongoing_requests=1000)
@serve.ingress(api)
class OpenAIIngress:
    def __init__(self, server, controller, model_name: str, max_tokens_default: int = 16, api_key: str | None = None,
                 metrics_need_key: bool = False, replica_wait_s: float = 60.0, channels: bool = False) -> None:
        """channels: streamed generations' deltas come by one channel to each replica (http/channels.py); it
        needs the goodput router, which sends a channel to the replica it names."""
        self.server = server
        self.controller = controller
        self.model_name = model_name
        self.max_tokens_default = max_tokens_default
        self.metrics = IngressMetrics()
        self.created = int(time.time())
        # the served config's api_key, else SMARTSPEC_API_KEY where this replica runs (a Secret on Kubernetes);
        # None: no key asked (a server on localhost)
        self.api_key = api_key or os.environ.get("SMARTSPEC_API_KEY") or None
        self.metrics_need_key = metrics_need_key
        self.replica_wait_s = replica_wait_s  # the most a generation waits for a replica to take it (failover.py)
        # the same cap the proxy guard keeps (proxy_guard.py), for a proxy that runs without it
        self.max_body_bytes = int(float(os.environ.get(proxy_guard.MAX_BODY_ENV, "8")) * 2**20)
        self._publishing = asyncio.get_event_loop().create_task(publish_key(self.api_key))
        # this ingress replica, whose death aborts its generations (replica/orphans.py); None outside one
        self.caller = ray.get_runtime_context().get_actor_id() if ray.is_initialized() else None
        self.channels = Channels(server, self.caller) if channels and self.caller else None

    def _refused(self, request: Request, endpoint: str | None = None) -> JSONResponse | None:
        """A 401 unless the request carries the key as `Authorization: Bearer <key>` (vLLM's and OpenAI's header);
        None: let it in. Refused before a body is read or a replica is asked."""
        if self.api_key is None:
            return None
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            return None
        if endpoint is not None:
            self.metrics.request_done(endpoint, 401)
        refusal = _error_response(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                                  "authorization")
        refusal.headers["WWW-Authenticate"] = "Bearer"
        return refusal

    # ---- plain routes --------------------------------------------------------------------------------------
    @api.get("/health")
    async def health(self):
        """200 once a model replica answers (loading the models takes minutes) with its engine running; 503 before,
        and for a replica whose engine has stopped (Serve replaces it once its own health check fails)."""
        try:
            running = await asyncio.wait_for(self.server.ping.remote(), 5)
        except Exception as exc:
            return _error_response(503, f"no model replica ready yet ({type(exc).__name__})")
        if not running:
            return _error_response(503, "a model replica's engine has stopped after an error; it is being replaced")
        return {"status": "ok"}

    @api.get("/v1/models")
    async def models(self, request: Request):
        if (refusal := self._refused(request)) is not None:
            return refusal
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "smartspec"}]}

    @api.get("/v1/smartspec/status")
    async def status(self, request: Request):
        if (refusal := self._refused(request)) is not None:
            return refusal
        try:
            return (await asyncio.wait_for(self.controller.status.remote(), 10)).as_dict()
        except Exception as exc:
            return _error_response(503, f"goodput controller unavailable: {exc!r}")

    @api.get("/metrics")
    async def metrics(self, request: Request):
        if self.metrics_need_key and (refusal := self._refused(request)) is not None:
            return refusal
        # the router's counters through their module: Serve may carry this class to the replica by value, with copies
        # of its module's objects
        text = self.metrics.render() + metrics.ROUTING.render()
        try:
            text += render_replica_metrics(await asyncio.wait_for(self.controller.status.remote(), 5))
        except Exception:
            pass  # the controller is away: ingress metrics alone
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    # ---- generation ----------------------------------------------------------------------------------------
    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._serve(request, Endpoint.COMPLETIONS)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._serve(request, Endpoint.CHAT)

    async def _serve(self, request: Request, endpoint: Endpoint):
        if (refusal := self._refused(request, endpoint.value)) is not None:
            return refusal
        raw = await self._body(request)
        if raw is None:
            self.metrics.request_done(endpoint.value, 413)
            return _error_response(413, f"request body over {self.max_body_bytes} bytes "
                                        f"({proxy_guard.MAX_BODY_ENV}); it was not read")
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            self.metrics.request_done(endpoint.value, 400)
            return _error_response(400, f"request body is not valid JSON: {exc}")
        result = await self._begin(data, endpoint)
        if isinstance(result, HTTPError):
            return result.response()
        fold, streams = result
        if fold.body.stream:
            usage = fold.body.stream_options is not None and fold.body.stream_options.include_usage
            return StreamingResponse(self._sse(fold, streams, usage), media_type="text/event-stream")
        try:
            return await self._collect(fold, streams)
        except HTTPError as exc:
            self.metrics.request_done(endpoint.value, exc.status)
            return exc.response()

    async def _body(self, request: Request) -> bytes | None:
        """The body, or None once it passes max_body_bytes (by its Content-Length, or as it is read)."""
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return None
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > self.max_body_bytes:
                return None
        return bytes(raw)

    # ---- the same API for Python callers (serve.get_app_handle) --------------------------------------------
    async def create(self, body: dict, chat: bool = False) -> dict:
        """A completion (chat=False) or chat completion as an OpenAI response dict, or {"error": {...}}."""
        result = await self._begin({**body, "stream": False}, Endpoint.CHAT if chat else Endpoint.COMPLETIONS)
        if isinstance(result, HTTPError):
            return answers.error_body(result.status, result.message, result.param)
        try:
            return await self._collect(*result)
        except HTTPError as exc:
            return answers.error_body(exc.status, exc.message)

    async def create_stream(self, body: dict, chat: bool = False):
        """Call with handle.options(stream=True): OpenAI stream chunks as dicts (no [DONE]), or one error dict."""
        result = await self._begin({**body, "stream": True}, Endpoint.CHAT if chat else Endpoint.COMPLETIONS)
        if isinstance(result, HTTPError):
            yield answers.error_body(result.status, result.message, result.param)
            return
        async with aclosing(self._chunks(*result, False)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def _begin(self, data, endpoint: Endpoint):
        """Validate, submit, wait for acceptance: (the answer's fold, streams), or the HTTPError to answer."""
        try:
            body = self._parse(data, SCHEMAS[endpoint])
            streams, accepted = await self._start(body, endpoint)  # one acceptance per choice
        except HTTPError as exc:
            self.metrics.request_done(endpoint.value, exc.status)
            return exc
        rid = answers.new_id(endpoint.id_prefix)
        return AnswerFold(rid, self.model_name, body, endpoint, accepted), streams

    def _parse(self, data, schema):
        if not isinstance(data, dict):
            raise HTTPError(400, "request body must be a JSON object")
        if (unsupported := proto.unsupported_field(data)) is not None:
            name, message = unsupported
            raise HTTPError(400, message, name)
        try:
            body = schema.model_validate(data)
        except ValidationError as exc:
            raise HTTPError(400, *_validation_message(exc)) from None
        if body.model != self.model_name:
            raise HTTPError(404, f"The model `{body.model}` does not exist; this server serves "
                                 f"`{self.model_name}`", "model")
        return body

    def _calls(self, body, endpoint: Endpoint) -> list[GenerateCall]:
        """The request's generations, as the replicas take them: n per prompt, prompt after prompt (OpenAI's order
        for a batch of prompts); n samples from one seed are distinct and reproducible (seed + i)."""
        try:  # OpenAI's defaults: 16 tokens for completions, up to the context's end for chat
            params, until_end, tools = body.generation(None if endpoint.is_chat else self.max_tokens_default)
        except (ValueError, TypeError) as exc:  # a value out of range; a schema, regex, grammar or tool refused
            raise HTTPError(400, str(exc), getattr(exc, "field", None)) from None
        if endpoint.is_chat:
            messages = template_messages([m.model_dump() for m in body.messages])
            key = prefix_text([(m.role, m.content or "") for m in body.messages], None)
            one_call = bool(tools) and body.tool_choice in (None, "auto") and not body.parallel_tool_calls
            prompts = [dict(messages=messages, tools=tools, prefix_text=key, one_tool_call=one_call)]
        else:
            prompts = [dict(prompt=p, echo=body.echo, prefix_text=prefix_text(None, p)) for p in body.prompts()]
        seeded = [params if params.seed is None else replace(params, seed=params.seed + i) for i in range(body.n)]
        return [GenerateCall(p, until_context_end=until_end, streamed=bool(body.stream), caller=self.caller, **prompt)
                for prompt in prompts for p in seeded]

    async def _start(self, body, endpoint: Endpoint):
        """Submit n generations; wait until each is accepted (or refused) so errors get their status code."""
        calls = self._calls(body, endpoint)
        streams = []
        try:
            streams = [FailoverStream(self._generate, call, body.stream, self.replica_wait_s) for call in calls]
            firsts = [await anext(s) for s in streams]
        except NoReplicaInTime as exc:
            self._cancel(streams)
            raise HTTPError.no_replica(exc) from None
        except BackPressureError as exc:
            self._cancel(streams)
            raise HTTPError(503, f"server overloaded, request queue full; retry later ({exc})") from None
        except Exception as exc:
            self._cancel(streams)
            raise HTTPError(503, f"no replica could take the request: {exc!r}") from None
        for first in firsts:
            if isinstance(first, Refused):
                self._cancel(streams)
                raise HTTPError(first.status, first.message, first.param)
        return streams, firsts

    def _generate(self, call: GenerateCall):
        if self.channels is not None and call.streamed:
            return self.channels.start(call)
        return self.server.options(stream=True).generate.remote(call)

    @staticmethod
    def _cancel(streams) -> None:
        for s in streams:
            s.cancel()

    async def _merged(self, streams):
        """(index, event) from n streams as events arrive."""
        if len(streams) == 1:
            async for event in streams[0]:
                yield 0, event
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i, s):
            try:
                async for event in s:
                    await queue.put((i, event))
            finally:
                await queue.put((i, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            live = len(streams)
            while live:
                i, event = await queue.get()
                if event is None:
                    live -= 1
                else:
                    yield i, event
        finally:
            for t in tasks:
                t.cancel()

    async def _collect(self, fold: AnswerFold, streams) -> dict:
        """The non-streamed answer: every event folded in, then the whole answer."""
        endpoint = fold.endpoint.value
        start, first_token = time.monotonic(), None
        try:
            async for i, event in self._merged(streams):
                first_token = first_token or time.monotonic()
                fold.feed(i, event)
        except asyncio.CancelledError:  # the caller went away: stop the generations
            self._cancel(streams)
            self.metrics.request_done(endpoint, 499)
            raise
        except NoReplicaInTime as exc:  # its replica died and no other took the retry in time
            self._cancel(streams)
            raise HTTPError.no_replica(exc) from None
        except GenerationFailedInServer as exc:  # the engine ended this generation alone, saying why
            self._cancel(streams)
            raise HTTPError(500, str(exc)) from None
        except Exception as exc:  # a replica failed mid-request: an explicit error, never a silent loss
            self._cancel(streams)
            raise HTTPError(500, f"generation failed: {exc!r}") from None
        finally:
            self.metrics.failed_over(streams)
        self.metrics.observe(endpoint, fold.prompt_tokens, fold.completion_tokens, start, first_token,
                             time.monotonic())
        return fold.response()

    async def _sse(self, fold: AnswerFold, streams, include_usage: bool):
        async with aclosing(self._chunks(fold, streams, include_usage)) as chunks:  # a hang-up closes both
            async for chunk in chunks:
                yield answers.sse(chunk)
        yield answers.sse("[DONE]")

    async def _chunks(self, fold: AnswerFold, streams, include_usage: bool):
        """The streamed answer's chunks as the events arrive; a failure after the status was sent, as an error
        chunk. The opening (the role) is held until the first event: a stream whose ingress replica dies before it is
        one whose client has read headers alone, and the proxy guard sends it again into the same response (a role
        chunk sent first made it a stream cut short, its client having seen no token)."""
        endpoint = fold.endpoint.value
        start, first_token = time.monotonic(), None
        completed, status = False, 499
        opening = list(fold.opening())
        try:
            async for i, event in self._merged(streams):
                first_token = first_token or time.monotonic()
                for chunk in [*opening, *fold.feed(i, event)]:
                    yield chunk
                opening = []
            for chunk in [*opening, *fold.closing(include_usage)]:
                yield chunk
            completed = True
        except asyncio.CancelledError:
            raise
        except NoReplicaInTime as exc:  # the status is sent already: say it in the stream
            status = 503
            for chunk in [*opening, answers.error_body(status, str(exc))]:
                yield chunk
        except GenerationFailedInServer as exc:
            status = 500
            for chunk in [*opening, answers.error_body(status, str(exc))]:
                yield chunk
        except Exception as exc:  # a replica failed mid-stream: the status is sent already; say it in the stream
            status = 500
            for chunk in [*opening, answers.error_body(status, f"generation failed: {exc!r}")]:
                yield chunk
        finally:
            self.metrics.failed_over(streams)
            if completed:
                self.metrics.observe(endpoint, fold.prompt_tokens, fold.completion_tokens, start, first_token,
                                     time.monotonic())
            else:  # the client went away (or a replica failed): cancelling the streams aborts the requests
                self._cancel(streams)
                self.metrics.request_done(endpoint, status)
