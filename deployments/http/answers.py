"""The OpenAI format's answers as JSON-ready dicts: responses, stream chunks, usage, logprobs in each endpoint's
shape, and error bodies (http/fold.py assembles them from a request's events; the ingress frames them as SSE)."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from enum import Enum

from deployments.wire import PredictionUsage, TokenEntry


class Endpoint(str, Enum):
    """The OpenAI endpoint a request came to: the shape of its answer; its value names it in metrics."""
    CHAT = "chat"  # /v1/chat/completions
    COMPLETIONS = "completions"  # /v1/completions

    @property
    def is_chat(self) -> bool:
        return self is Endpoint.CHAT

    @property
    def object(self) -> str:
        """The answer's `object`."""
        return "chat.completion" if self.is_chat else "text_completion"

    @property
    def chunk_object(self) -> str:
        """A streamed chunk's `object`."""
        return "chat.completion.chunk" if self.is_chat else "text_completion"

    @property
    def id_prefix(self) -> str:
        return "chatcmpl" if self.is_chat else "cmpl"


@dataclass(frozen=True)
class AnswerHead:
    """What each chunk and the whole answer of one request carry: its id, the model, its endpoint, when it began."""
    rid: str
    model: str
    endpoint: Endpoint
    created: int


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, details: dict | None = None) -> dict:
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if details is not None:
        out["completion_tokens_details"] = details
    return out


def prediction_details(usages: list[PredictionUsage | None]) -> dict:
    """usage.completion_tokens_details of a request with a predicted output: its draft tokens from the prediction
    that verification accepted and rejected, over its choices."""
    total = sum((u for u in usages if u is not None), PredictionUsage())
    return {"accepted_prediction_tokens": total.accepted_prediction_tokens,
            "rejected_prediction_tokens": total.rejected_prediction_tokens}


def completion_response(head: AnswerHead, choices: list[dict], prompt_tokens: int, completion_tokens: int,
                        details: dict | None = None) -> dict:
    return {"id": head.rid, "object": head.endpoint.object, "created": head.created, "model": head.model,
            "choices": choices, "usage": usage(prompt_tokens, completion_tokens, details)}


def chat_logprobs(entries: list[TokenEntry]) -> dict:
    def one(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, v) for t, v in e.top]}
                        for e in entries], "refusal": None}


def completion_logprobs(entries: list[TokenEntry | None], first_tokens: list[str] | None = None,
                        offset: int = 0) -> dict:
    """The legacy completions shape; entries None (a prompt's first token) get a null logprob, their token text
    from first_tokens, in order."""
    first = iter(first_tokens or [])
    tokens, values, tops, offsets = [], [], [], []
    for e in entries:
        token = next(first) if e is None else e.token
        tokens.append(token)
        values.append(None if e is None else e.logprob)
        tops.append(None if e is None else {t: v for t, v in e.top})
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def choice(index: int, text: str | None, finish_reason: str | None, endpoint: Endpoint, spec: dict | None = None,
           logprobs: dict | None = None, tool_calls: list[dict] | None = None) -> dict:
    body = ({"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs}
            if endpoint.is_chat
            else {"index": index, "text": text, "logprobs": logprobs})
    if tool_calls:
        body["message"]["tool_calls"] = tool_calls
    body["finish_reason"] = finish_reason
    if spec is not None:
        body["speculation"] = spec  # proposed / accepted draft tokens of this choice (a SmartSpec extension)
    return body


def stream_chunk(head: AnswerHead, index: int, text: str | None, finish_reason: str | None, role: bool = False,
                 logprobs: dict | None = None, tool_calls: list[dict] | None = None) -> dict:
    if head.endpoint.is_chat:
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        if tool_calls:
            delta["tool_calls"] = tool_calls
        c = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    else:
        c = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
    return {"id": head.rid, "object": head.endpoint.chunk_object, "created": head.created, "model": head.model,
            "choices": [c]}


def usage_chunk(head: AnswerHead, prompt_tokens: int, completion_tokens: int, details: dict | None = None) -> dict:
    return {"id": head.rid, "object": head.endpoint.chunk_object, "created": head.created, "model": head.model,
            "choices": [], "usage": usage(prompt_tokens, completion_tokens, details)}


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def error_body(status: int, message: str, param: str | None = None) -> dict:
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            422: "invalid_request_error",
            429: "rate_limit_error", 503: "service_unavailable"}.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
