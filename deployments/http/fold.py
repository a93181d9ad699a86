"""One request's answer as a fold over the events of its n generations: each event in gives the stream chunks it
adds (a streamed answer sends them as they come), and the state it leaves is the whole answer (a non-streamed one
is `response()` after the last event). One fold, so both shapes say the same thing."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from deployments.http import answers
from deployments.http.answers import AnswerHead, Endpoint
from deployments.http.protocol import ChatCompletionRequest, CompletionRequest
from deployments.http.tools import CallStream
from deployments.http.tools import parse as parse_tool_calls
from deployments.wire import Accepted, Delta, Event, PredictionUsage, Restart, TokenEntry


class GenerationFailedInServer(RuntimeError):
    """The engine ended a generation because its part of a step failed (Delta.error): a 500 with that message, or
    a stream's error event. The engine and the other generations went on."""


@dataclass
class _Choice:
    """One generation's answer so far."""
    text: str = ""  # as generated (an echo's prompt first)
    entries: list[TokenEntry] = field(default_factory=list)
    prompt_entries: list[TokenEntry | None] | None = None
    completion_tokens: int = 0
    finish_reason: str | None = None
    speculation: dict | None = None
    prediction: PredictionUsage | None = None
    calls: CallStream | None = None  # with tools: the text split into content and tool calls as it streams
    stream_offset: int = 0  # completions' logprobs: where the next streamed token starts in the text


class AnswerFold:
    """A request's answer in the shape of its endpoint (chat or completions), from its generations' events."""

    def __init__(self, rid: str, model: str, body: CompletionRequest | ChatCompletionRequest, endpoint: Endpoint,
                 accepted: list[Accepted]) -> None:
        self.head, self.body, self.endpoint = AnswerHead(rid, model, endpoint, int(time.time())), body, endpoint
        chat = endpoint.is_chat
        self.accepted = accepted
        self.prompt_tokens = sum(a.prompt_tokens for a in accepted[::body.n])  # each prompt once
        self.echo = not chat and body.echo
        self.wants_logprobs = body.logprobs if chat else body.logprobs is not None
        # chat with tools the model may call: its answers are read for tool-call blocks
        self.reads_tool_calls = chat and bool(body.tools) and body.tool_choice != "none"
        self.max_calls = None if not self.reads_tool_calls or body.parallel_tool_calls else 1
        self.choices = [self._fresh() for _ in accepted]

    def _fresh(self) -> _Choice:
        return _Choice(calls=CallStream(self.max_calls) if self.reads_tool_calls else None)

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)

    # ---- events in, stream chunks out -------------------------------------------------------------------------
    def opening(self) -> list[dict]:
        """The chunks before any token: chat's role, per choice."""
        if not self.endpoint.is_chat:
            return []
        return [answers.stream_chunk(self.head, i, None, None, role=True)
                for i in range(len(self.choices))]

    def feed(self, index: int, event: Event) -> list[dict]:
        """Fold one generation's event in; the stream chunks it adds."""
        if isinstance(event, Restart):  # retried whole on another replica: its tokens so far are void
            self.choices[index] = self._fresh()
            return []
        if not isinstance(event, Delta):
            return []
        if event.error is not None:
            raise GenerationFailedInServer(event.error)
        choice = self.choices[index]
        text = self.accepted[index].prompt_text + event.text if self.echo and event.first else event.text
        choice.text += text
        choice.entries += event.logprobs or []
        if event.prompt_logprobs is not None:
            choice.prompt_entries = event.prompt_logprobs
        choice.completion_tokens = event.completion_tokens
        logprobs = self._logprobs(index, event.logprobs or [], event.prompt_logprobs, choice.stream_offset)
        if logprobs is not None and not self.endpoint.is_chat:
            choice.stream_offset += sum(len(t) for t in logprobs["tokens"])
        made = []
        if choice.calls is not None:  # content before and between tool-call blocks; each block as it closes
            text, made = choice.calls.feed(text)
            text += choice.calls.finish() if event.finished else ""
        chunks = []
        if text or made or (logprobs is not None and event.token_ids):
            chunks.append(answers.stream_chunk(self.head, index, text, None, logprobs=logprobs, tool_calls=made))
        if event.finished:
            choice.speculation, choice.prediction = event.speculation, event.prediction
            choice.finish_reason = event.finish_reason
            if choice.calls is not None and choice.calls.num_calls and event.finish_reason == "stop":
                choice.finish_reason = "tool_calls"
            chunks.append(answers.stream_chunk(self.head, index, None, choice.finish_reason))
        return chunks

    def closing(self, include_usage: bool) -> list[dict]:
        """The chunks after the last event: usage, when asked."""
        if not include_usage:
            return []
        return [answers.usage_chunk(self.head, self.prompt_tokens, self.completion_tokens, self._details())]

    # ---- the whole answer ---------------------------------------------------------------------------------
    def response(self) -> dict:
        """The non-streamed answer: every choice whole, and the request's usage."""
        out = []
        for i, c in enumerate(self.choices):
            text, calls = parse_tool_calls(c.text, self.max_calls) if self.reads_tool_calls else (c.text, [])
            reason = "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason
            out.append(answers.choice(i, text, reason, self.endpoint, c.speculation,
                                      self._logprobs(i, c.entries, c.prompt_entries), calls))
        return answers.completion_response(self.head, out, self.prompt_tokens, self.completion_tokens,
                                           self._details())

    def _details(self) -> dict | None:
        if self.body.prediction is None:
            return None
        return answers.prediction_details([c.prediction for c in self.choices])

    def _logprobs(self, index: int, entries: list[TokenEntry], prompt_entries: list | None,
                  offset: int = 0) -> dict | None:
        """Choice `index`'s logprobs for these output entries (and the prompt's, echoed), None when not asked."""
        if not self.wants_logprobs:
            return None
        if self.endpoint.is_chat:
            return answers.chat_logprobs(entries)
        firsts = None
        if self.echo and prompt_entries is not None:
            entries, firsts = list(prompt_entries) + list(entries), [self.accepted[index].prompt_first_token]
        return answers.completion_logprobs(entries, firsts, offset)
