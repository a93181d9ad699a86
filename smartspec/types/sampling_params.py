"""Per-request sampling parameters, validated on construction."""
from __future__ import annotations

from dataclasses import dataclass, field

from smartspec.types.numbers import is_int, is_number


class ParamError(ValueError):
    """A request field with a value out of its range; `field` names it (what the API's 4xx reports as param)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field

    def __reduce__(self):  # raised in one Ray process and read in another
        return ParamError, (self.field, str(self))


GREEDY_BELOW = 1e-5  # a temperature below it decodes greedily (SamplingParams.greedy)


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match; exactly one is set (vLLM's `structured_outputs` fields). Compiled into a
    grammar per request by smartspec.structured, which names the field of a schema or grammar it rejects."""
    json: dict | None = None  # a JSON schema
    # strict (OpenAI's json_schema.strict, on unless a request says false): objects that list their properties take
    # no others, and a keyword the grammar cannot enforce is refused; false: the schema as JSON Schema reads it
    # (objects open unless closed), unsupported keywords ignored
    strict: bool = True
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None  # one of these strings
    grammar: str | None = None  # a Lark grammar (llguidance's dialect) or GBNF
    # one or more tool calls in the Hermes / Qwen2.5 format, `<tool_call>\n{"name": ..., "arguments": {...}}\n
    # </tool_call>`, each naming one of these functions ({"name", "parameters": a JSON schema}) with valid arguments
    tool_calls: list[dict] | None = None
    max_tool_calls: int = 1  # calls in a row at most
    # the grammar as compiled once (smartspec.structured.compile.compiled): (llguidance grammar, the field it came
    # from, whether the tool-call tags were tokens); carried with the request so that no later stage compiles it again
    compiled: tuple[str, str, bool] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        set_ = [k for k in ("json", "regex", "choice", "grammar", "tool_calls") if getattr(self, k) is not None]
        set_ += ["json_object"] if self.json_object else []
        if len(set_) != 1:
            raise ParamError("structured_outputs", f"structured_outputs takes exactly one of json, json_object, "
                                                   f"regex, choice, grammar; got {set_ or 'none'}")
        if self.tool_calls is not None and (not self.tool_calls or any(
                not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]
                for f in self.tool_calls)):
            raise ParamError("tools", "each tool needs a function name")
        if not is_int(self.max_tool_calls) or self.max_tool_calls < 1:
            raise ParamError("tools", f"max_tool_calls must be an integer >= 1, got {self.max_tool_calls!r}")
        if not isinstance(self.strict, bool):
            raise ParamError("strict", f"strict must be true or false, got {self.strict!r}")
        if self.json is not None and not isinstance(self.json, dict):
            raise ParamError("structured_outputs.json", "structured_outputs.json must be a JSON schema (an object)")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ParamError(f"structured_outputs.{name}", f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or any(not isinstance(c, str) or not c for c in self.choice)):
            raise ParamError("structured_outputs.choice", "structured_outputs.choice must be non-empty strings")


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0 (anything below GREEDY_BELOW) = greedy
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Cap this request's speculation length (0 = never speculate); None = the engine's K (the config's
    # num_speculative_tokens, `k_max` in the engine). The server's speculation.max_k maps here.
    k_cap: int | None = None
    # Log-probabilities (the target's log-softmax) of each output token with this many alternatives (0-20);
    # None = not computed. prompt_logprobs: the same for the prompt's tokens (the first has none).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Controls that reshape the target's logits from the request's history (runtime/logits_controls.py), applied
    # to every verified position with the draft tokens before it, so speculation stays lossless with them.
    presence_penalty: float = 0.0  # [-2, 2]: subtracted from the logit of each token already in the output
    frequency_penalty: float = 0.0  # [-2, 2]: times the token's count in the output
    repetition_penalty: float = 1.0  # > 0: logits of tokens in the prompt or output divided (> 0) or multiplied
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit, in [-100, 100]
    min_p: float = 0.0  # [0, 1]: drop tokens less likely than min_p x the most likely one (after temperature)
    # end-of-sequence, stop token ids and stop strings take effect after this many tokens; a structured output's
    # grammar that is complete allows nothing more, so it ends the output there, min_tokens or not
    min_tokens: int = 0
    # the output must match this (a JSON schema, regex, choice or grammar); every verified position is masked
    structured: StructuredOutput | None = None
    # the output the client expects (OpenAI's predicted outputs: the file being edited), as text or token ids:
    # drafted from where the output has got to in it, priced by the policy like any proposer
    prediction: str | list[int] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self._check_counts()
        self._check_numbers()
        self._check_tokens()
        if isinstance(self.structured, dict):
            self.structured = StructuredOutput(**self.structured)
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ParamError("structured_outputs", f"structured must be a StructuredOutput, got {self.structured!r}")

    def _check_counts(self) -> None:
        """The integer fields, each in its range."""
        for name, low, high, what in (("max_tokens", 1, None, "an integer >= 1"),
                                      ("top_k", 0, None, "an integer >= 0 (0 disables it)"),
                                      ("min_tokens", 0, self.max_tokens, "an integer in [0, max_tokens]")):
            value = getattr(self, name)
            if not is_int(value) or value < low or (high is not None and value > high):
                raise ParamError(name, f"{name} must be {what}, got {value!r}")
        for name, high, what in (("seed", None, "a non-negative integer"),
                                 ("k_cap", None, "an integer >= 0"),
                                 ("logprobs", 20, "an integer in [0, 20] (alternatives per token)"),
                                 ("prompt_logprobs", 20, "an integer in [0, 20] (alternatives per token)")):
            value = getattr(self, name)  # these may be None: unset
            if value is not None and (not is_int(value) or value < 0 or (high is not None and value > high)):
                raise ParamError(name, f"{name} must be {what}, got {value!r}")

    def _check_numbers(self) -> None:
        """The real-valued fields, each in its range."""
        if not is_number(self.temperature) or self.temperature < 0:
            raise ParamError("temperature", f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ParamError("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_number(v) or not -2 <= v <= 2:
                raise ParamError(name, f"{name} must be a number in [-2, 2], got {v!r}")
        if not is_number(self.repetition_penalty) or not 0 < self.repetition_penalty <= 10:
            raise ParamError("repetition_penalty",
                             f"repetition_penalty must be a number in (0, 10], got {self.repetition_penalty!r}")
        if not is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ParamError("min_p", f"min_p must be a number in [0, 1], got {self.min_p!r}")

    def _check_tokens(self) -> None:
        """The fields that name tokens or text: logit_bias, prediction, stop strings and ids."""
        if not isinstance(self.logit_bias, dict):
            raise ParamError("logit_bias", f"logit_bias must map token ids to numbers, got {self.logit_bias!r}")
        self.logit_bias = dict(self.logit_bias)
        for tok, bias in self.logit_bias.items():
            if not is_int(tok) or tok < 0 or not is_number(bias) or not -100 <= bias <= 100:
                raise ParamError("logit_bias", f"logit_bias maps token ids (integers >= 0) to numbers in [-100, 100]; "
                                 f"got {tok!r}: {bias!r}")
        if self.prediction is not None and not (
                isinstance(self.prediction, str)
                or isinstance(self.prediction, list) and all(is_int(t) and t >= 0 for t in self.prediction)):
            raise ParamError("prediction", "prediction must be text or a list of token ids")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ParamError("stop", f"stop must be non-empty strings, got {self.stop!r}")
        if any(not is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ParamError("stop_token_ids",
                             f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        """Temperatures below GREEDY_BELOW decode greedily: dividing logits by them overflows float32 to inf (and
        the softmax to NaN), and the distribution they ask for is the argmax but for exact ties (vLLM's rule)."""
        return self.temperature < GREEDY_BELOW

    @property
    def reshapes_logits(self) -> bool:
        """Whether a logits row depends on the tokens before it (penalties, bias, min_tokens): then each verified
        position is reshaped with its own history."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias or self.min_tokens)

