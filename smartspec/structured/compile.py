"""A request's `StructuredOutput` as an llguidance grammar, checked; torch-free, so the HTTP front refuses a bad
schema or grammar (a 400 naming its field) before any replica sees it. Why llguidance: structured/matcher.py."""
from __future__ import annotations

import json
from dataclasses import replace

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from smartspec.types.sampling_params import ParamError, StructuredOutput

# A JSON value for {"type": "json_object"}: any object (OpenAI's JSON mode).
ANY_OBJECT = {"type": "object"}
# The Hermes / Qwen2.5 tool-call block's tags, `<tool_call>\n{...}\n</tool_call>`
TOOL_CALL_TAGS = ("<tool_call>", "</tool_call>")
# The layouts a JSON answer may take. compact: one line as json.dumps writes it, the separators fixed (the grammar
# forces them, so jump-forward has more to draft). flexible (the default; xgrammar's and vLLM's allow whitespace
# too): between tokens, nothing, one space, or a newline and an indent, as a model pretty-prints; not free runs of
# blanks, which a model that may write them pads with (an enum after 20 spaces). Bytes the grammar still forces (a
# key's rest after its opening quote) are drafted as before. llguidance fills what a schema's own "x-guidance"
# leaves out from the defaults given, so each layout names every key.
JSON_LAYOUTS = {"compact": {"whitespace_flexible": False, "whitespace_pattern": None, "item_separator": ", ",
                            "key_separator": ": "},
                "flexible": {"whitespace_flexible": True, "whitespace_pattern": r"(?:\n[\x20\t]{0,32}|\x20)?",
                             "item_separator": ",", "key_separator": ":"}}  # the blanks after: the pattern's
DEFAULT_JSON_LAYOUT = "flexible"


def json_layout(name: str = DEFAULT_JSON_LAYOUT) -> dict:
    """llguidance's JSON options for a layout of JSON_LAYOUTS (a schema's own "x-guidance" overrides them)."""
    return dict(JSON_LAYOUTS[name])


def compiled(spec: StructuredOutput, tool_tags_are_tokens: bool = False) -> StructuredOutput:
    """The spec with its grammar compiled and checked, carried along (`StructuredOutput.compiled`): the HTTP front
    compiles a request's once and the replica's engine reuses it (a tool-call grammar is compiled again only where
    the tokenizer's tags differ from what it was compiled for)."""
    if _carried(spec, tool_tags_are_tokens) is not None:
        return spec
    return replace(spec, compiled=(*grammar_of(spec, tool_tags_are_tokens), tool_tags_are_tokens))


def _carried(spec: StructuredOutput, tool_tags_are_tokens: bool) -> tuple[str, str] | None:
    if spec.compiled is None or (spec.tool_calls is not None and spec.compiled[2] != tool_tags_are_tokens):
        return None
    return spec.compiled[0], spec.compiled[1]


def grammar_of(spec: StructuredOutput, tool_tags_are_tokens: bool = False) -> tuple[str, str]:
    """(llguidance grammar, the request field it came from); a grammar llguidance rejects raises ParamError naming
    that field. tool_tags_are_tokens: the tokenizer has `<tool_call>` and `</tool_call>` as tokens of their own
    (Qwen2.5), which the grammar must then name as tokens, not spell out. A grammar the spec carries is used as
    it is."""
    if (carried := _carried(spec, tool_tags_are_tokens)) is not None:
        return carried
    if spec.tool_calls is not None:
        field, what = "tools", "tool parameters schema"
        grammar = llguidance.LLMatcher.grammar_from_lark(
            tool_calls_lark(spec.tool_calls, tool_tags_are_tokens, spec.max_tool_calls))
    elif spec.json is not None or spec.json_object:
        field, what = "structured_outputs.json", "JSON schema"
        # an empty schema ({}) is any JSON value, not JSON mode's any object
        schema = ANY_OBJECT if spec.json_object else closed_objects(spec.json) if spec.strict else spec.json
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(schema), defaults={**json_layout(_layout_asked(schema)), "lenient": not spec.strict})
        except ValueError as exc:
            raise ParamError(field, f"invalid JSON schema: {exc}") from None
    elif spec.regex is not None:
        field, what = "structured_outputs.regex", "regex"
        grammar = llguidance.LLMatcher.grammar_from_regex(spec.regex)
    elif spec.choice is not None:
        field, what = "structured_outputs.choice", "choice"
        grammar = llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    else:
        field, what = "structured_outputs.grammar", "grammar"
        grammar = _lark_or_gbnf(spec.grammar)
    refuse_invalid(grammar, field, what)
    return grammar, field


def refuse_invalid(grammar: str, field: str, what: str, tokenizer: llguidance.LLTokenizer | None = None) -> None:
    """ParamError naming the request's field where llguidance refuses the grammar (warnings pass); with a
    tokenizer, the special tokens the grammar names are checked against it too."""
    error = (llguidance.LLMatcher.validate_grammar(grammar) if tokenizer is None
             else llguidance.LLMatcher.validate_grammar(grammar, tokenizer))
    if error and not error.startswith("WARNING"):
        raise ParamError(field, f"invalid {what}: {error.strip().splitlines()[0][:300]}")


def _layout_asked(schema: dict) -> str:
    """The layout a schema's own x-guidance asks for: `whitespace_flexible: false` alone means compact (llguidance
    would otherwise keep the default's whitespace pattern beside it)."""
    own = schema.get("x-guidance") if isinstance(schema, dict) else None
    return "compact" if isinstance(own, dict) and own.get("whitespace_flexible") is False else DEFAULT_JSON_LAYOUT


def closed_objects(schema):
    """The schema with every object that lists its properties and says nothing of others closed to them
    (`additionalProperties: false`), as OpenAI's strict mode requires and xgrammar's strict mode (vLLM's default)
    assumes: a model left free to add keys goes on adding them. allOf's members stay as written (closing each
    would refuse what the others add)."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _closed_child(key, value) for key, value in schema.items()}
    if isinstance(out.get("properties"), dict) and not {"additionalProperties", "patternProperties",
                                                       "unevaluatedProperties"} & set(out):
        out["additionalProperties"] = False
    return out


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMAS = ("items", "prefixItems", "additionalProperties", "anyOf", "oneOf", "not", "if", "then", "else",
            "contains")


def _closed_child(key: str, value):
    if key in _SCHEMA_MAPS and isinstance(value, dict):
        return {name: closed_objects(s) for name, s in value.items()}
    return closed_objects(value) if key in _SCHEMAS else value


def tool_calls_lark(functions: list[dict], tags_are_tokens: bool, max_calls: int = 1) -> str:
    """One to max_calls calls, each `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`, newline-separated;
    the arguments valid for the named function's parameters. A bound, because a model made to call tools that
    was not trained for this format goes on calling (the next city, and the next) rather than end."""
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                               "arguments": f.get("parameters") or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    # one line, as the chat template shows the model its calls (`{"name": ..., "arguments": ...}`)
    schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "x-guidance": json_layout("compact")}
    open_tag, close_tag = TOOL_CALL_TAGS if tags_are_tokens else tuple(json.dumps(t) for t in TOOL_CALL_TAGS)
    start = "start: call" + ' ("\\n" call' * (max_calls - 1) + ")?" * (max_calls - 1)
    return f'{start}\ncall: {open_tag} "\\n" %json {json.dumps(schema)} "\\n" {close_tag}\n'


def _lark_or_gbnf(text: str) -> str:
    """A Lark grammar as llguidance reads it, or GBNF (llama.cpp's and xgrammar's EBNF, `root ::= ...`)
    converted to one."""
    try:
        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(text))
    except Exception:  # neither parses as GBNF: let the Lark parser name the error
        return llguidance.LLMatcher.grammar_from_lark(text)
