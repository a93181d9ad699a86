"""The answer's fold (deployments/http/fold.py): a request's events give the stream chunks and, at the end, the
whole answer, and the two say the same thing; a Restart voids a generation's tokens so far. No Ray."""
import pytest
from tool_defs import WEATHER

from deployments.http.answers import Endpoint
from deployments.http.fold import AnswerFold, GenerationFailedInServer
from deployments.http.protocol import ChatCompletionRequest, CompletionRequest
from deployments.wire import Accepted, Delta, PredictionUsage, Restart, TokenEntry

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'


def deltas(pieces: list[str], reason: str = "stop", **last) -> list[Delta]:
    out = [Delta(p, [i], i + 1, first=i == 0) for i, p in enumerate(pieces[:-1])]
    n = len(pieces)
    return out + [Delta(pieces[-1], [n - 1], n, first=n == 1, finished=True, finish_reason=reason, **last)]


def streamed_text(chunks: list[dict], chat: bool) -> str:
    key = (lambda c: c["delta"].get("content") or "") if chat else (lambda c: c["text"])
    return "".join(key(c) for chunk in chunks for c in chunk["choices"])


def test_a_chat_with_tool_calls_streams_what_the_whole_answer_says():
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 "tools": [WEATHER], "n": 2})
    fold = AnswerFold("id", "m", body, Endpoint.CHAT, [Accepted(5), Accepted(5)])
    chunks = fold.opening()
    for event in deltas(["Let me look.\n", CALL[:30], CALL[30:]]):
        chunks += fold.feed(0, event)
    for event in deltas(["It is ", "sunny."]):
        chunks += fold.feed(1, event)
    whole = fold.response()
    first, second = whole["choices"]
    assert first["finish_reason"] == "tool_calls" and first["message"]["content"] == "Let me look."
    assert first["message"]["tool_calls"][0]["function"] == {"name": "get_weather",
                                                             "arguments": '{"city": "Paris", "unit": "C"}'}
    assert second["finish_reason"] == "stop" and second["message"]["content"] == "It is sunny."
    calls = [c for chunk in chunks for c in chunk["choices"] if c["delta"].get("tool_calls")]
    assert [c["index"] for c in calls] == [0] and calls[0]["delta"]["tool_calls"][0]["function"]["name"] == \
        "get_weather"
    by_choice = [[chunk for chunk in chunks if chunk["choices"][0]["index"] == i] for i in (0, 1)]
    assert streamed_text(by_choice[0], True) == "Let me look." and streamed_text(by_choice[1], True) == "It is sunny."
    assert whole["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}


def test_a_restart_voids_the_tokens_so_far_and_the_retry_answers():
    body = CompletionRequest.model_validate({"model": "m", "prompt": "p", "prediction": {"type": "content",
                                                                                          "content": "xy"}})
    fold = AnswerFold("id", "m", body, Endpoint.COMPLETIONS, [Accepted(1)])
    fold.feed(0, Delta("lost ", [1], 1, first=True))
    fold.feed(0, Restart())
    for event in deltas(["kept"], prediction=PredictionUsage(3, 1)):
        fold.feed(0, event)
    whole = fold.response()
    assert whole["choices"][0]["text"] == "kept" and whole["usage"]["completion_tokens"] == 1
    assert whole["usage"]["completion_tokens_details"] == {"accepted_prediction_tokens": 3,
                                                           "rejected_prediction_tokens": 1}


def test_an_echoed_completion_with_logprobs_streams_the_offsets_the_whole_answer_has():
    body = CompletionRequest.model_validate({"model": "m", "prompt": "ab", "echo": True, "logprobs": 1})
    fold = AnswerFold("id", "m", body, Endpoint.COMPLETIONS, [Accepted(2, "ab", "a")])
    prompt = [None, TokenEntry("b", -0.5, (("b", -0.5),))]
    events = [Delta("c", [3], 1, first=True, logprobs=[TokenEntry("c", -1.0, (("c", -1.0),))],
                    prompt_logprobs=prompt),
              Delta("de", [4], 2, finished=True, finish_reason="length",
                    logprobs=[TokenEntry("de", -2.0, (("de", -2.0),))])]
    chunks = [c for e in events for c in fold.feed(0, e)]
    whole = fold.response()["choices"][0]
    assert whole["text"] == streamed_text(chunks, False) == "abcde"
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert sum((s["tokens"] for s in streamed), []) == whole["logprobs"]["tokens"] == ["a", "b", "c", "de"]
    assert sum((s["text_offset"] for s in streamed), []) == whole["logprobs"]["text_offset"] == [0, 1, 2, 3]
    assert whole["logprobs"]["token_logprobs"] == [None, -0.5, -1.0, -2.0]


def test_deltas_held_back_and_sent_as_one_fold_into_the_same_answer():
    """A replica holds an unstreamed answer's deltas and sends them as one (Delta.then): the whole answer, its
    logprobs, offsets and reports are those of the deltas sent one by one."""
    body = CompletionRequest.model_validate({"model": "m", "prompt": "ab", "echo": True, "logprobs": 1})
    prompt = [None, TokenEntry("b", -0.5, (("b", -0.5),))]
    spec = {"proposed": 3, "accepted": 2}
    events = [Delta("c", [3], 1, first=True, logprobs=[TokenEntry("c", -1.0, (("c", -1.0),))],
                    prompt_logprobs=prompt),
              Delta("de", [4, 5], 3, logprobs=[TokenEntry("d", -2.0), TokenEntry("e", -0.1)]),
              Delta("", [], 3),
              Delta("f", [6], 4, finished=True, finish_reason="length", speculation=spec,
                    prediction=PredictionUsage(1, 2), logprobs=[TokenEntry("f", -3.0)])]
    one_by_one = AnswerFold("id", "m", body, Endpoint.COMPLETIONS, [Accepted(2, "ab", "a")])
    for e in events:
        one_by_one.feed(0, e)
    held = events[1].then(events[2]).then(events[3])
    assert held.token_ids == [4, 5, 6] and held.text == "def" and not held.first and held.finished
    assert held.speculation == spec and held.prediction == PredictionUsage(1, 2) and held.prompt_logprobs is None
    merged = events[0].then(held)
    assert merged.first and merged.prompt_logprobs == prompt and merged.completion_tokens == 4
    for sent in ([events[0], held], [merged]):
        fold = AnswerFold("id", "m", body, Endpoint.COMPLETIONS, [Accepted(2, "ab", "a")])
        for e in sent:
            fold.feed(0, e)
        assert fold.response()["choices"] == one_by_one.response()["choices"]
        assert fold.response()["choices"][0]["text"] == "abcdef"
    assert Delta("x", [1], 1).then(Delta("y", [2], 2)).logprobs is None  # none asked: none made up


def test_a_generation_the_engine_ended_with_an_error_fails_with_its_message():
    """The engine ended one generation (its part of a step failed): the fold raises its message, which the front
    answers as a 500 (or a stream's error event); a sibling choice's tokens are folded as before."""
    body = CompletionRequest.model_validate({"model": "m", "prompt": "x", "n": 2})
    fold = AnswerFold("id", "m", body, Endpoint.COMPLETIONS, [Accepted(1), Accepted(1)])
    fold.feed(1, deltas(["fine"])[0])
    fold.feed(0, Delta("ab", [1, 2], 2, first=True))
    message = "the server failed at this request's grammar: RuntimeError: boom"
    with pytest.raises(GenerationFailedInServer) as failed:
        fold.feed(0, Delta("", [], 2, finished=True, finish_reason="error", error=message))
    assert str(failed.value) == message
