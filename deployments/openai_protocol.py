"""The OpenAI wire format: request bodies (validated), responses, stream chunks and error bodies."""
from __future__ import annotations

import json
import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from smartspec.sampling_params import SamplingParams


class SpeculationOverride(BaseModel):
    """Per-request experiment knob: cap this request's speculation (0 = never speculate)."""
    model_config = ConfigDict(extra="forbid")
    max_k: int = Field(ge=0, le=32)


class StreamOptions(BaseModel):
    include_usage: bool = False  # a last chunk with no choices and the request's token usage


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields we do not use (user, logprobs=None)
    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0)
    n: int = Field(1, ge=1, le=8)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    speculation: SpeculationOverride | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stops

    def sampling_params(self, default_max_tokens: int | None) -> dict:
        """SamplingParams fields; max_tokens None = up to the end of the context (the replica knows it)."""
        max_tokens = self.max_completion_tokens or self.max_tokens or default_max_tokens
        SamplingParams(max_tokens=max_tokens or 1, temperature=self.temperature, top_p=self.top_p,
                       top_k=self.top_k, seed=self.seed, stop=self.stop or [])  # checked here, built in the replica
        return dict(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                    top_k=self.top_k, seed=self.seed, stop=self.stop or [], ignore_eos=self.ignore_eos)


class CompletionRequest(_Common):
    prompt: str | list[int] = Field(min_length=1)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)


# ---- responses --------------------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_response(rid: str, model: str, choices: list[dict], prompt_tokens: int, completion_tokens: int,
                        chat: bool) -> dict:
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}


def choice(index: int, text: str, finish_reason: str | None, chat: bool, spec: dict | None = None) -> dict:
    body = ({"index": index, "message": {"role": "assistant", "content": text}} if chat
            else {"index": index, "text": text, "logprobs": None})
    body["finish_reason"] = finish_reason
    if spec is not None:
        body["speculation"] = spec  # proposed / accepted draft tokens of this choice (a SmartSpec extension)
    return body


def stream_chunk(rid: str, model: str, index: int, text: str | None, finish_reason: str | None, chat: bool,
                 created: int, role: bool = False) -> str:
    if chat:
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        c = {"index": index, "delta": delta, "finish_reason": finish_reason}
        body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [c]}
    else:
        c = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        body = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [c]}
    return f"data: {json.dumps(body)}\n\n"


def usage_chunk(rid: str, model: str, chat: bool, created: int, prompt_tokens: int, completion_tokens: int) -> str:
    return sse({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": model, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def error_body(status: int, message: str, param: str | None = None) -> dict:
    kind = {400: "invalid_request_error", 404: "not_found_error", 422: "invalid_request_error",
            429: "rate_limit_error", 503: "service_unavailable"}.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
