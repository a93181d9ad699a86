"""Committing a step's tokens where only stop tokens and lengths can end a request (no stop strings, no grammar):
the tokens appended and the finish reason are those of appending the tokens one at a time (a stop token, unless it
is an end the request ignores, then max_tokens, then the context bound, checked after each token)."""
import random

from smartspec.engine.commit import TokenCommitter
from smartspec.types.request import Request
from smartspec.types.sampling_params import SamplingParams

EOS = 2


def one_at_a_time(req: Request, new: list[int], max_model_len: int) -> tuple[list[int], str | None]:
    p = req.params
    for i, tok in enumerate(new):
        out, total = req.num_output_tokens + i + 1, req.num_tokens + i + 1
        if tok in p.stop_token_ids or (not p.ignore_eos and tok == EOS):
            return new[:i + 1], "stop"
        if out >= p.max_tokens or total >= max_model_len:
            return new[:i + 1], "length"
    return list(new), None


def test_the_counted_append_ends_where_token_by_token_appending_does():
    rng = random.Random(0)
    reasons = set()
    for case in range(2000):
        prompt = [rng.randrange(3, 9) for _ in range(rng.randrange(1, 6))]
        params = SamplingParams(max_tokens=rng.randrange(1, 12), ignore_eos=rng.random() < 0.3,
                                stop_token_ids=rng.sample([3, 4, 5], rng.randrange(0, 3)))
        req = Request(f"r{case}", prompt, params)
        req.token_ids.extend(rng.randrange(6, 9) for _ in range(rng.randrange(0, params.max_tokens)))
        max_model_len = req.num_tokens + rng.randrange(1, 10)
        new = [rng.choice([2, 3, 4, 5, 6, 7, 8, 8, 8]) for _ in range(rng.randrange(1, 6))]
        before = list(req.token_ids)
        expected = one_at_a_time(req, new, max_model_len)
        got = TokenCommitter(None, {EOS}, max_model_len)._append(req, new, None)
        assert got == expected, (case, new, params, before)
        assert req.token_ids == before + expected[0]
        reasons.add(got[1])
    assert reasons == {"stop", "length", None}  # every way out was taken


def test_each_output_keeps_the_tokens_it_had_after_later_steps(tiny_qwen):
    """A step's RequestOutput hands on the request's output tokens as they were then, without copying them: after
    the request has run on, each output still holds exactly the new tokens handed out up to it; it compares equal
    to that list, slices as it, and pickles as a plain list (a view that kept reading the live tokens would fail)."""
    import pickle

    from smartspec.config import EngineConfig
    from smartspec.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=tiny_qwen, num_kv_blocks=64, quantization=None, use_kernels=False,
                                    speculative_config={"method": "ngram", "num_speculative_tokens": 3}))
    engine.add_request("abcabcabcabc", SamplingParams(max_tokens=30, ignore_eos=True), request_id="a")
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    engine.close()
    so_far = []
    for out in outputs:
        so_far = so_far + out.new_token_ids
        assert out.token_ids == so_far and list(out.token_ids) == so_far and len(out.token_ids) == len(so_far)
        assert out.token_ids[1:-1] == so_far[1:-1] and out.token_ids[::-2] == so_far[::-2]
        kept = pickle.loads(pickle.dumps(out))
        assert type(kept.token_ids) is list and kept.token_ids == so_far
    assert len(outputs) > 3 and len(so_far) == 30
