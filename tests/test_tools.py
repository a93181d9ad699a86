"""Tool calling in the Hermes / Qwen2.5 format: answers are read into OpenAI's tool_calls (whole and as a stream),
`required` and named choices constrain the answer to valid calls (with and without speculation), bad tools are
refused naming the field, and the real Qwen2.5 template renders calls and results for the next turn."""
import json

import jsonschema
import pytest
from engines import PROMPTS, make
from tool_defs import ADD, WEATHER

from deployments.http.tools import CallStream, ToolError, functions, parse, template_messages
from smartspec import SamplingParams
from smartspec.types.sampling_params import StructuredOutput

ANSWER = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n'
          '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')


def test_answers_are_read_into_tool_calls():
    content, calls = parse(ANSWER)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Paris", "unit": "C"}), ("add", {"a": 1, "b": 2})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    assert parse("no call <tool_call> not json </tool_call>") == ("no call <tool_call> not json </tool_call>", [])


@pytest.mark.parametrize("chunk", [1, 2, 5, 13, 1000])
def test_a_streamed_answer_gives_the_same_content_and_calls(chunk):
    for text in (ANSWER, "plain answer\n", '<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>\n'):
        want_content, want_calls = parse(text)
        stream, content, calls = CallStream(), "", []
        for i in range(0, len(text), chunk):
            delta, made = stream.feed(text[i:i + chunk])
            content += delta
            calls += made
        content += stream.finish()
        assert (content or None) == want_content if want_calls else content == text
        assert [c["function"] for c in calls] == [c["function"] for c in want_calls]
        assert [c["index"] for c in calls] == list(range(len(want_calls)))


@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_one_call_at_most_keeps_the_first_streamed_or_whole(chunk):
    """parallel_tool_calls false: the first call is the answer's, later ones are dropped, in both shapes."""
    content, calls = parse(ANSWER, max_calls=1)
    assert content == "Let me check." and [c["function"]["name"] for c in calls] == ["get_weather"]
    stream, made = CallStream(max_calls=1), []
    for i in range(0, len(ANSWER), chunk):
        made += stream.feed(ANSWER[i:i + chunk])[1]
    stream.finish()
    assert [(c["function"], c["index"]) for c in made] == [(calls[0]["function"], 0)]


def test_tool_choice_decides_the_prompt_and_the_constraint():
    assert functions([WEATHER], "auto") == ([WEATHER], None)
    assert functions([WEATHER], "none") == ([], None)  # the tools stay out of the prompt
    _, calls = functions([WEATHER, ADD], "required")
    assert [c["name"] for c in calls["tool_calls"]] == ["get_weather", "add"] and calls["max_tool_calls"] == 2
    assert functions([WEATHER, ADD], "required", parallel=False)[1]["max_tool_calls"] == 1
    _, calls = functions([WEATHER, ADD], {"type": "function", "function": {"name": "add"}})
    assert [c["name"] for c in calls["tool_calls"]] == ["add"] and calls["max_tool_calls"] == 1
    with pytest.raises(ToolError, match="not among tools") as err:
        functions([WEATHER], {"type": "function", "function": {"name": "nope"}})
    assert err.value.field == "tool_choice"
    with pytest.raises(ToolError, match="needs tools"):
        functions([], "required")


def test_assistant_calls_reach_the_template_with_object_arguments():
    messages = template_messages([
        {"role": "user", "content": "hi", "tool_calls": None},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "content": "3", "tool_call_id": "call_1"}])
    assert messages[0] == {"role": "user", "content": "hi"}
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2}
    assert messages[2] == {"role": "tool", "content": "3", "tool_call_id": "call_1"}


@pytest.mark.parametrize("most", [1, 2])
def test_required_calls_are_valid_with_and_without_speculation(tiny_qwen, tiny_qwen_draft, most):
    _, calls = functions([WEATHER, ADD], "required")
    params = [SamplingParams(max_tokens=200, structured=StructuredOutput(**{**calls, "max_tool_calls": most}))] * 4
    plain = make(tiny_qwen).generate(PROMPTS, params)
    spec = {"method": "draft_model", "model": tiny_qwen_draft, "num_speculative_tokens": 4, "policy": "fixed"}
    assert [o.token_ids for o in make(tiny_qwen, spec).generate(PROMPTS, params)] == [o.token_ids for o in plain]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}
    for out in plain:
        assert out.finish_reason == "stop", out.text
        content, made = parse(out.text)
        assert content is None and 1 <= len(made) <= most, out.text
        for call in made:
            jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])


@pytest.mark.real_model
def test_qwen_template_and_tool_tags_as_tokens():
    """Qwen2.5's `<tool_call>` is a token of its own: the grammar names it as one, and the real template renders
    an assistant's calls and the tool's result for the next turn."""
    from smartspec import LLM

    llm = LLM("qwen2.5-coder-0.5b", num_kv_blocks=64, max_model_len=512)
    _, calls = functions([WEATHER], "required")
    grammar = llm.engine.grammar_compiler.matcher(StructuredOutput(**calls))
    assert llm.engine.grammar_compiler.tool_tags_are_tokens
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
    ids = llm.tokenizer(call, add_special_tokens=False).input_ids
    assert ids[0] == llm.tokenizer.convert_tokens_to_ids("<tool_call>") and grammar.valid_prefix(ids) == len(ids)
    messages = template_messages([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
        {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1"}])
    prompt = llm.tokenizer.apply_chat_template(messages, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    assert '"name": "get_weather"' in prompt and call.split("\n")[1] in prompt
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in prompt
    out = llm.generate(prompt, SamplingParams(max_tokens=48))[0]
    assert out.finish_reason in ("stop", "length") and out.text  # the model answers from the tool's result
    # parallel_tool_calls false under "auto": the replica's params end the answer at its first call's closing
    # tag, which stays in the text (the front reads the block whole); a grammar makes the model call twice
    from deployments.replica.prompts import ending_at_first_call

    block = f"<tool_call> {json.dumps(chr(10) + call.split(chr(10))[1] + chr(10))} </tool_call>"
    twice = StructuredOutput(grammar=f'start: {block} "\\n" {block}')
    free = llm.generate(prompt, SamplingParams(max_tokens=80, structured=twice))[0]
    assert free.text.count("</tool_call>") == 2
    params = ending_at_first_call(SamplingParams(max_tokens=80, structured=twice), llm.tokenizer)
    first = llm.generate(prompt, params)[0]
    assert first.finish_reason == "stop" and first.text == call, first.text
    assert [c["function"]["name"] for c in parse(first.text)[1]] == ["get_weather"]
