"""The OpenAI format's requests: bodies validated into typed fields, each error naming its field (the answers:
answers.py)."""
from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from deployments.http.tools import ToolError
from deployments.http.tools import functions as tool_functions
from smartspec.structured.compile import compiled
from smartspec.types.sampling_params import ParamError, SamplingParams, StructuredOutput


class SpeculationOverride(BaseModel):
    """Per-request experiment knob: cap this request's speculation (0 = never speculate)."""
    model_config = ConfigDict(extra="forbid")
    max_k: int = Field(ge=0, le=32)


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")  # description
    name: str = Field(min_length=1, max_length=64)
    schema_: dict = Field(default_factory=dict, alias="schema")  # an empty schema: any JSON value
    # true or absent: objects take only the properties they list, unsupported keywords refused; false: the schema
    # as JSON Schema reads it (StructuredOutput.strict). The output is constrained to the schema either way.
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text (no constraint), json_object (JSON mode), or json_schema."""
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given exactly when type is \"json_schema\"")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs: exactly one of these."""
    model_config = ConfigDict(extra="forbid")
    json_: dict | str | None = Field(None, alias="json")  # a JSON schema (or its text)
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark (llguidance) or GBNF

    def spec(self) -> dict:
        return {"json": _schema(self.json_, "structured_outputs.json"), "json_object": self.json_object,
                "regex": self.regex, "choice": self.choice, "grammar": self.grammar}


def _joined_text_parts(v):
    """OpenAI's list of content parts, of which text parts are served (joined); a string stays itself."""
    if isinstance(v, list):
        if any(not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str) for p in v):
            raise ValueError("only text content parts ({\"type\": \"text\", \"text\": ...}) are served")
        return "".join(p["text"] for p in v)
    return v


def _schema(value: dict | str | None, field: str) -> dict | None:
    """A JSON schema given as an object or as its text."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        raise ParamError(field, f"{field} is not valid JSON") from None


class Prediction(BaseModel):
    """OpenAI's predicted output: the text the answer is expected to be, mostly (a file being edited)."""
    model_config = ConfigDict(extra="forbid")
    type: Literal["content"]
    content: str = Field(min_length=1)

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, v):
        return _joined_text_parts(v)


class StreamOptions(BaseModel):
    include_usage: bool = False  # a last chunk with no choices and the request's token usage


# OpenAI (and vLLM) request fields this server does not implement, with the values that mean "not used": a
# request that sets one to anything else is refused with a 400 naming it, never answered as if it were honoured.
UNSUPPORTED = {
    "best_of": (None, 1), "suffix": (None, ""), "use_beam_search": (None, False), "length_penalty": (None, 1, 1.0),
    "functions": (None, []), "function_call": (None, "none"),
    "audio": (None,),
    "modalities": (None, ["text"]), "logits_processors": (None, []),
}


def unsupported_field(data: dict) -> tuple[str, str] | None:
    """The first field set to a value this server would not honour, and a message; None when there is none."""
    for name, neutral in UNSUPPORTED.items():
        if name in data and not any(data[name] == v and type(data[name]) is type(v) or data[name] is v
                                    for v in neutral):
            return name, (f"`{name}` is not supported by this server (got {json.dumps(data[name])[:80]}); "
                          "leave it out or at its default")
    return None


SAMPLING_CONTROLS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_p",
                     "min_tokens")


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")  # fields no generation depends on (user, store, metadata)
    model: str
    # bounds that SamplingParams checks are checked there alone (its errors name the field, a 400 like these);
    # here only what the OpenAI API adds: temperature <= 2, n, stop, and the fields SamplingParams names otherwise
    max_tokens: int | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, le=2)
    top_p: float = 1.0
    top_k: int = 0
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = Field(1, ge=1, le=8)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] = Field(default_factory=dict)  # token id (a JSON key: a string) -> bias in [-100, 100]
    min_p: float = 0.0
    min_tokens: int = 0
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's older spellings of structured_outputs' fields
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    prediction: Prediction | None = None
    speculation: SpeculationOverride | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_controls_are_unset(cls, data):
        """Clients send null for a sampling control they do not set: it means the default."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in SAMPLING_CONTROLS}
        return data

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, v):
        try:  # JSON keys are strings; their ranges are SamplingParams'
            return {int(k): b for k, b in v.items()}
        except ValueError:
            raise ValueError("logit_bias keys are token ids (integers as strings)") from None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stops

    def generation(self, default_max_tokens: int | None) -> tuple[SamplingParams, bool, list[dict] | None]:
        """The request's SamplingParams, built here alone: its sampling controls, its output's constraint (a
        structured output, or the tool calls tool_choice asks for) and its cap on speculation; whether it runs to
        the end of the context (no max_tokens given: the replica, which knows the context, sets it); and the tools
        the chat template shows the model (None: none). A value the engine refuses raises ValueError naming its
        field."""
        given = [m for m in (self.max_completion_tokens, self.max_tokens, default_max_tokens) if m is not None]
        max_tokens = given[0] if given else None
        structured = self.structured()
        tools, constraint = self.tool_calls()
        if constraint is not None and structured is not None:
            raise ToolError("tool_choice", f"tool_choice {self.tool_choice!r} constrains the answer to tool calls; "
                                           f"it cannot also follow {structured[1]}")
        output = compiled(StructuredOutput(**constraint)) if constraint is not None else \
            structured[0] if structured is not None else None
        params = SamplingParams(max_tokens=max(1, self.min_tokens) if max_tokens is None else max_tokens,
                                temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
                                stop=self.stop or [], ignore_eos=self.ignore_eos,
                                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                                repetition_penalty=self.repetition_penalty, logit_bias=self.logit_bias,
                                min_p=self.min_p, min_tokens=self.min_tokens,
                                prediction=self.prediction.content if self.prediction else None,
                                structured=output, k_cap=self.speculation.max_k if self.speculation else None,
                                **self.logprob_fields())
        return params, max_tokens is None, tools

    def tool_calls(self) -> tuple[list[dict] | None, dict | None]:
        """The tools the prompt shows the model, and the constraint tool_choice puts on the answer (StructuredOutput
        fields); (None, None) where the request has none (completions have none)."""
        return None, None

    def logprob_fields(self) -> dict:
        return {}

    def structured(self) -> tuple[StructuredOutput, str] | None:
        """The output's constraint, its grammar compiled (and carried to the replica), and the request field it came
        from (what an error names); None: free text. One source at most; a grammar that does not compile raises
        ParamError."""
        sources = []
        if self.response_format is not None and self.response_format.type != "text":
            fmt = self.response_format
            # json_schema's schema as given (an empty one is any JSON value); json_object: any object
            sources.append(({"json": fmt.json_schema.schema_, "strict": fmt.json_schema.strict is not False}
                             if fmt.type == "json_schema" else {"json_object": True}, "response_format"))
        if self.structured_outputs is not None:
            sources.append((self.structured_outputs.spec(), "structured_outputs"))
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            if (value := getattr(self, name)) is not None:
                key = name.removeprefix("guided_")
                sources.append(({key: _schema(value, name) if key == "json" else value}, name))
        if len(sources) > 1:
            raise ParamError(sources[1][1], f"one output constraint at a time; got {[n for _, n in sources]}")
        if not sources:
            return None
        spec, field = sources[0]
        try:
            return compiled(StructuredOutput(**{k: v for k, v in spec.items() if v not in (None, False)})), field
        except ParamError as exc:
            raise ParamError(field if field != "structured_outputs" else exc.field, str(exc)) from None


def _is_batch(prompt) -> bool:
    """A list of prompts (texts or token-id lists), not one prompt (a text, or one list of token ids)."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))


class CompletionRequest(_Common):
    # one prompt (text or token ids), or a batch of them: n choices per prompt, in prompt order
    prompt: str | list[int] | list[str] | list[list[int]] = Field(min_length=1)
    logprobs: int | None = None  # alternatives per token (0-20); 0: the chosen token's alone
    echo: bool = False  # the prompt before the completion (with its logprobs when logprobs is set)

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v):
        if _is_batch(v) and any(not p for p in v):
            raise ValueError("a batch of prompts holds no empty prompt")
        if _is_batch(v) and len(v) > 64:
            raise ValueError("a batch holds at most 64 prompts")
        return v

    def prompts(self) -> list[str | list[int]]:
        return list(self.prompt) if _is_batch(self.prompt) else [self.prompt]

    def logprob_fields(self) -> dict:
        return {"logprobs": self.logprobs, "prompt_logprobs": self.logprobs if self.echo else None}


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1)
    arguments: str | dict = "{}"  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    # or OpenAI's list of content parts, of which text parts are served (joined); None: an assistant's tool calls
    content: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result: the call it answers
    name: str | None = None

    @model_validator(mode="after")
    def _has_content(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        return self

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, v):
        return _joined_text_parts(v)


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def logprob_fields(self) -> dict:
        return {"logprobs": (self.top_logprobs or 0) if self.logprobs else None}

    def tool_calls(self) -> tuple[list[dict] | None, dict | None]:
        if not self.tools and self.tool_choice in (None, "auto", "none"):
            return None, None
        choice = self.tool_choice.model_dump() if hasattr(self.tool_choice, "model_dump") else self.tool_choice
        return tool_functions([t.model_dump(exclude_none=True) for t in self.tools or []], choice,
                              self.parallel_tool_calls)
