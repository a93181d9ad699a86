"""The OpenAI-compatible HTTP front (FastAPI through @serve.ingress): validation and status codes here, tokens
from the LLMServer replicas through a streaming handle."""

import asyncio
import json
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.serve.exceptions import BackPressureError

from deployments import metrics
from deployments import openai_protocol as proto
from deployments import openai_responses as wire
from deployments.failover import RESTART, FailoverStream
from deployments.metrics import IngressMetrics, render_replica_metrics
from deployments.tools import CallStream, ToolError, template_messages
from deployments.tools import functions as tool_functions
from deployments.tools import parse as parse_tool_calls
from smartspec.structured.compile import grammar_of
from smartspec.types.sampling_params import StructuredOutput

api = FastAPI(title="SmartSpec", description="OpenAI-compatible LLM serving with goodput-chosen speculation")


class HTTPError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def _error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(wire.error_body(status, message, param), status_code=status)


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0]
    loc = ".".join(str(p) for p in first["loc"])
    extra = f" ({len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
    return f"{loc}: {first['msg']}{extra}", loc or None


@serve.deployment(name="OpenAIIngress", ray_actor_options={"num_cpus": 0.1}, max_ongoing_requests=1000)
@serve.ingress(api)
class OpenAIIngress:
    def __init__(self, server, controller, model_name: str, max_tokens_default: int = 16) -> None:
        self.server = server
        self.controller = controller
        self.model_name = model_name
        self.max_tokens_default = max_tokens_default
        self.metrics = IngressMetrics()
        self.created = int(time.time())

    # ---- plain routes --------------------------------------------------------------------------------------
    @api.get("/health")
    async def health(self):
        """200 once a model replica answers (loading the models takes minutes), 503 before."""
        try:
            await asyncio.wait_for(self.server.ping.remote(), 5)
        except Exception as exc:
            return _error_response(503, f"no model replica ready yet ({type(exc).__name__})")
        return {"status": "ok"}

    @api.get("/v1/models")
    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "smartspec"}]}

    @api.get("/v1/smartspec/status")
    async def status(self):
        try:
            return await asyncio.wait_for(self.controller.status.remote(), 10)
        except Exception as exc:
            return _error_response(503, f"goodput controller unavailable: {exc!r}")

    @api.get("/metrics")
    async def metrics(self) -> PlainTextResponse:
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
        return await self._serve(request, proto.CompletionRequest, chat=False)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._serve(request, proto.ChatCompletionRequest, chat=True)

    async def _serve(self, request: Request, schema, chat: bool):
        raw = await request.body()
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            self.metrics.request_done("chat" if chat else "completions", 400)
            return _error_response(400, f"request body is not valid JSON: {exc}")
        result = await self._begin(data, schema, chat)
        if isinstance(result, HTTPError):
            return _error_response(result.status, result.message, result.param)
        rid, gen, streams = result
        if gen.body.stream:
            usage = gen.body.stream_options is not None and gen.body.stream_options.include_usage
            return StreamingResponse(self._sse(rid, streams, gen, usage), media_type="text/event-stream")
        try:
            return await self._collect(rid, streams, gen)
        except HTTPError as exc:
            self.metrics.request_done("chat" if chat else "completions", exc.status)
            return _error_response(exc.status, exc.message)

    # ---- the same API for Python callers (serve.get_app_handle) --------------------------------------------
    async def create(self, body: dict, chat: bool = False) -> dict:
        """A completion (chat=False) or chat completion as an OpenAI response dict, or {"error": {...}}."""
        result = await self._begin({**body, "stream": False}, proto.ChatCompletionRequest if chat
                                   else proto.CompletionRequest, chat)
        if isinstance(result, HTTPError):
            return wire.error_body(result.status, result.message, result.param)
        rid, gen, streams = result
        try:
            return await self._collect(rid, streams, gen)
        except HTTPError as exc:
            return wire.error_body(exc.status, exc.message)

    async def create_stream(self, body: dict, chat: bool = False):
        """Call with handle.options(stream=True): OpenAI stream chunks as dicts (no [DONE]), or one error dict."""
        result = await self._begin({**body, "stream": True}, proto.ChatCompletionRequest if chat
                                   else proto.CompletionRequest, chat)
        if isinstance(result, HTTPError):
            yield wire.error_body(result.status, result.message, result.param)
            return
        rid, gen, streams = result
        async for chunk in self._sse(rid, streams, gen):
            if chunk != wire.sse("[DONE]"):
                yield json.loads(chunk[len("data: "):])

    async def _begin(self, data, schema, chat: bool):
        """Validate, submit, wait for acceptance: (id, Generation, streams), or the HTTPError to answer."""
        try:
            body = self._parse(data, schema)
            streams, accepted = await self._start(body, chat)  # one acceptance per choice
        except HTTPError as exc:
            self.metrics.request_done("chat" if chat else "completions", exc.status)
            return exc
        return wire.new_id("chatcmpl" if chat else "cmpl"), wire.Generation(body, chat, accepted), streams

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

    async def _start(self, body, chat: bool):
        """Submit n generations; wait until each is accepted (or refused) so errors get their status code."""
        try:
            # OpenAI's defaults: 16 tokens for completions, up to the context's end for chat
            params = body.sampling_params(None if chat else self.max_tokens_default)
        except ValueError as exc:
            raise HTTPError(400, str(exc), getattr(exc, "field", None)) from None
        tools = None
        try:
            if (structured := body.structured()) is not None:
                params["structured"] = structured[0]
            if chat and (body.tools or body.tool_choice not in (None, "auto", "none")):
                choice = body.tool_choice.model_dump() if hasattr(body.tool_choice, "model_dump") else body.tool_choice
                tools, constraint = tool_functions([t.model_dump(exclude_none=True) for t in body.tools or []],
                                                   choice, body.parallel_tool_calls)
                if constraint is not None:
                    if structured is not None:
                        raise ToolError("tool_choice", f"tool_choice {body.tool_choice!r} constrains the answer to "
                                                       f"tool calls; it cannot also follow {structured[1]}")
                    grammar_of(StructuredOutput(**constraint))
                    params["structured"] = constraint
        except (ValueError, TypeError) as exc:  # a schema, regex, grammar or tool the library refuses
            raise HTTPError(400, str(exc), getattr(exc, "field", None)) from None
        if body.speculation is not None:
            params["max_speculative_tokens"] = body.speculation.max_k
        payloads = ([{"messages": template_messages([m.model_dump() for m in body.messages]), "tools": tools}] if chat
                    else [{"prompt": prompt, "echo": body.echo} for prompt in body.prompts()])
        streams = []
        try:
            # choices: n per prompt, prompt after prompt (OpenAI's order for a batch of prompts)
            for payload in payloads:
                for i in range(body.n):
                    p = dict(params)
                    if p["seed"] is not None:
                        p["seed"] += i  # n samples from one seed: distinct, and reproducible
                    streams.append(FailoverStream(self._generate, {**payload, "params": p}, body.stream))
            firsts = [await anext(s) for s in streams]
        except BackPressureError as exc:
            self._cancel(streams)
            raise HTTPError(503, f"server overloaded, request queue full; retry later ({exc})") from None
        except HTTPError:
            raise
        except Exception as exc:
            self._cancel(streams)
            raise HTTPError(503, f"no replica could take the request: {exc!r}") from None
        for first in firsts:
            if first["type"] == "error":
                self._cancel(streams)
                raise HTTPError(first["status"], first["message"], first.get("param"))
        return streams, firsts

    def _generate(self, payload: dict):
        return self.server.options(stream=True).generate.remote(payload)

    @staticmethod
    def _cancel(streams) -> None:
        for s in streams:
            try:
                s.cancel()
            except Exception:  # a stream refused at submission re-raises its refusal here: it has nothing to stop
                pass

    async def _merged(self, streams):
        """(index, item) from n streams as items arrive."""
        if len(streams) == 1:
            async for item in streams[0]:
                yield 0, item
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i, s):
            try:
                async for item in s:
                    await queue.put((i, item))
            finally:
                await queue.put((i, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            live = len(streams)
            while live:
                i, item = await queue.get()
                if item is None:
                    live -= 1
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()

    async def _collect(self, rid, streams, gen: wire.Generation):
        chat, prompt_tokens = gen.chat, gen.prompt_tokens
        endpoint = "chat" if chat else "completions"
        start = time.monotonic()
        texts, reasons, specs, counts = ([""] * len(streams), [None] * len(streams), [None] * len(streams),
                                         [0] * len(streams))
        entries, prompt_entries = [[] for _ in streams], [None] * len(streams)
        first_token = None
        try:
            async for i, item in self._merged(streams):
                if item["type"] == RESTART["type"]:  # retried whole on another replica: its tokens so far are void
                    texts[i], entries[i], prompt_entries[i], counts[i] = "", [], None, 0
                    continue
                first_token = first_token or time.monotonic()
                texts[i] += gen.text(i, item)
                entries[i] += item.get("logprobs") or []
                if item.get("prompt_logprobs") is not None:
                    prompt_entries[i] = item["prompt_logprobs"]
                counts[i] = item["completion_tokens"]
                if item["finished"]:
                    reasons[i], specs[i] = item["finish_reason"], item["spec"]
        except asyncio.CancelledError:  # the caller went away: stop the generations
            self._cancel(streams)
            self.metrics.request_done(endpoint, 499)
            raise
        except Exception as exc:  # a replica failed mid-request: an explicit error, never a silent loss
            self._cancel(streams)
            raise HTTPError(500, f"generation failed: {exc!r}") from None
        finally:
            self.metrics.failed_over(streams)
        choices = []
        for i in range(len(streams)):
            text, calls = parse_tool_calls(texts[i]) if gen.reads_tool_calls else (texts[i], [])
            reason = "tool_calls" if calls and reasons[i] == "stop" else reasons[i]
            choices.append(wire.choice(i, text, reason, chat, specs[i],
                                        gen.logprobs(i, entries[i], prompt_entries[i]), calls))
        self.metrics.observe(endpoint, prompt_tokens, sum(counts), start, first_token, time.monotonic())
        details = wire.prediction_details(specs) if gen.body.prediction is not None else None
        return wire.completion_response(rid, self.model_name, choices, prompt_tokens, sum(counts), chat, details)

    async def _sse(self, rid, streams, gen: wire.Generation, include_usage: bool = False):
        chat, prompt_tokens = gen.chat, gen.prompt_tokens
        endpoint = "chat" if chat else "completions"
        start, created = time.monotonic(), int(time.time())
        first_token, total, specs = None, [0] * len(streams), [None] * len(streams)
        calls = [CallStream() for _ in streams] if gen.reads_tool_calls else None
        completed, status = False, 499
        try:
            if chat:
                for i in range(len(streams)):
                    yield wire.stream_chunk(rid, self.model_name, i, None, None, chat, created, role=True)
            async for i, item in self._merged(streams):
                first_token = first_token or time.monotonic()
                total[i] = item["completion_tokens"]
                text = gen.text(i, item)
                logprobs = gen.logprobs(i, item.get("logprobs") or [], item.get("prompt_logprobs"))
                made = []
                if calls is not None:  # content before and between tool-call blocks; each block as it closes
                    text, made = calls[i].feed(text)
                    text += calls[i].finish() if item["finished"] else ""
                if text or made or (logprobs is not None and item["token_ids"]):
                    yield wire.stream_chunk(rid, self.model_name, i, text, None, chat, created, logprobs=logprobs,
                                             tool_calls=made)
                if item["finished"]:
                    specs[i] = item["spec"]
                    reason = item["finish_reason"]
                    if calls is not None and calls[i].num_calls and reason == "stop":
                        reason = "tool_calls"
                    yield wire.stream_chunk(rid, self.model_name, i, None, reason, chat, created)
            if include_usage:
                details = wire.prediction_details(specs) if gen.body.prediction is not None else None
                yield wire.usage_chunk(rid, self.model_name, chat, created, prompt_tokens, sum(total), details)
            yield wire.sse("[DONE]")
            completed = True
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a replica failed mid-stream: the status is sent already; say it in the stream
            status = 500
            yield wire.sse(wire.error_body(status, f"generation failed: {exc!r}"))
            yield wire.sse("[DONE]")
        finally:
            self.metrics.failed_over(streams)
            if completed:
                self.metrics.observe(endpoint, prompt_tokens, sum(total), start, first_token, time.monotonic())
            else:  # the client went away (or a replica failed): cancelling the streams aborts the requests
                self._cancel(streams)
                self.metrics.request_done(endpoint, status)
