"""Tool calling in the Hermes / Qwen2.5 format: the tools go to the model's chat template, the model answers
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks, and they come back to the client as OpenAI's
`tool_calls` (whole, or as stream deltas). `tool_choice` "required" or a named function constrains the answer to
calls (smartspec.structured: valid JSON arguments for the function's parameters); "auto" lets the model choose;
"none" leaves the tools out of the prompt."""
from __future__ import annotations

import json
import re
import uuid

from smartspec.structured.compile import TOOL_CALL_TAGS

OPEN, CLOSE = TOOL_CALL_TAGS
CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class ToolError(ValueError):
    """A request's tools or tool_choice that cannot be honoured; `field` names it (a 400)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def functions(tools: list[dict], tool_choice, parallel: bool = True) -> tuple[list[dict], dict | None]:
    """(the tools as the chat template takes them, the answer's constraint as StructuredOutput fields; None: the
    model is free to call or not). tools: OpenAI's [{"type": "function", "function": {"name", "description",
    "parameters"}}]. A named function is called once; "required" calls up to one per tool (parallel), else one."""
    names = [t["function"]["name"] for t in tools]
    if tool_choice in (None, "auto", "none"):
        return ([] if tool_choice == "none" else tools), None
    if tool_choice == "required":
        if not tools:
            raise ToolError("tool_choice", "tool_choice \"required\" needs tools")
        return tools, {"tool_calls": [_callable(t) for t in tools], "max_tool_calls": len(tools) if parallel else 1}
    name = tool_choice["function"]["name"]
    if name not in names:
        raise ToolError("tool_choice", f"tool_choice names function {name!r}, which is not among tools {names}")
    return tools, {"tool_calls": [_callable(tools[names.index(name)])], "max_tool_calls": 1}


def _callable(tool: dict) -> dict:
    f = tool["function"]
    return {"name": f["name"], "parameters": f.get("parameters") or {"type": "object"}}


def template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI messages as chat templates read them: an assistant's tool calls with their arguments as objects
    (OpenAI sends them as JSON text), a tool result with its call id."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _arguments(c["function"])}}
                               for c in m["tool_calls"]]
        out.append(m)
    return out


def _arguments(function: dict):
    args = function.get("arguments")
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return args


def parse(text: str, max_calls: int | None = None) -> tuple[str | None, list[dict]]:
    """An answer's text outside its tool-call blocks (None if nothing is left) and its calls, as OpenAI's
    `tool_calls`. A block that is not a JSON call with a name stays in the text; calls past max_calls
    (parallel_tool_calls false: 1) are dropped."""
    calls, kept, end = [], [], 0
    for m in CALL.finditer(text):
        call = _call(m.group(1))
        if call is None:
            continue
        kept.append(text[end:m.start()])
        end = m.end()
        if max_calls is None or len(calls) < max_calls:
            calls.append(call)
    kept.append(text[end:])
    content = "".join(kept).strip()
    return (content or None) if calls else text, calls  # without calls the text is the answer, as written


def _call(body: str) -> dict | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", {})
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}}


class CallStream:
    """One choice's streamed text split into content deltas and whole tool calls as their blocks close. Text that
    may still become a block's opening tag is held back, and so is whitespace until text follows it (the newlines
    around blocks are not content)."""

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls  # calls past it are dropped (parallel_tool_calls false: 1)
        self.pending, self.held = "", ""
        self.num_calls, self.sent = 0, False

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.pending += text
        content, calls = "", []
        while (start := self.pending.find(OPEN)) >= 0 and (end := self.pending.find(CLOSE, start)) >= 0:
            end += len(CLOSE)
            _, found = parse(self.pending[start:end])
            content += self.pending[:start] if found else self.pending[:end]
            if self.max_calls is not None:
                found = found[:max(0, self.max_calls - self.num_calls)]
            calls.extend(dict(c, index=self.num_calls + i) for i, c in enumerate(found))
            self.num_calls += len(found)
            self.pending = self.pending[end:]
        start = self.pending.find(OPEN)
        cut = start if start >= 0 else len(self.pending) - _partial_tag(self.pending)
        content, self.pending = content + self.pending[:cut], self.pending[cut:]
        self.held += content
        keep = len(self.held) - len(self.held.rstrip())
        out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        if not self.sent:
            out = out.lstrip()
        self.sent |= bool(out)
        return out, calls

    def finish(self) -> str:
        """What is left at the end (an unclosed block is text); whitespace around calls is not content, as
        `parse` strips it."""
        rest, self.pending, self.held = self.held + self.pending, "", ""
        if self.num_calls and not rest.strip():
            return ""
        return rest if self.sent else rest.lstrip()


def _partial_tag(text: str) -> int:
    """How many chars at the end of text could begin the opening tag."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
