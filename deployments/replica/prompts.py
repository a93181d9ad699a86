"""A call's prompt as the engine takes it: a chat's messages through the model's chat template, and the params of
a chat whose answer ends at its first tool call."""
from __future__ import annotations

from dataclasses import replace

from deployments.wire import GenerateCall
from smartspec.structured.compile import TOOL_CALL_TAGS
from smartspec.types.sampling_params import SamplingParams


def prompt_of(call: GenerateCall, tokenizer, model_name: str) -> str | list[int]:
    """The completion's prompt, or the chat's messages (and tools) through the chat template."""
    if call.messages is None:
        return call.prompt
    if not tokenizer.chat_template:
        raise ValueError(f"model {model_name!r} has no chat template; use /v1/completions")
    return tokenizer.apply_chat_template(call.messages, tools=call.tools or None, tokenize=False,
                                         add_generation_prompt=True)


def ending_at_first_call(params: SamplingParams, tokenizer) -> SamplingParams:
    """params whose generation ends with its first tool call (parallel_tool_calls false under "auto"): the block's
    closing tag a stop token where the tokenizer has it as one (Qwen2.5's); else unchanged, and the front keeps
    the first call of what comes."""
    ids = tokenizer.encode(TOOL_CALL_TAGS[1], add_special_tokens=False)
    return replace(params, stop_token_ids=[*params.stop_token_ids, ids[0]]) if len(ids) == 1 else params
