"""Engines for the tests: tiny prompts and parameters, policies that set k per request and step, requests joining
while others decode, and the speculative configs the lossless tests run (imported by the test modules)."""
from smartspec import LLM, SamplingParams
from smartspec.policy import GoodputPolicy, Policy

# repetitive prompts give prompt lookup something to find
PROMPTS = ["abcabcabcabc abc", "def f(x): return x\ndef g(x): return x\ndef", "xyz " * 8, "hello world"]


class StepPolicy(Policy):
    """k from a function of (step, request index, K): lets a test give each request its own k, step by step."""
    name = "step-function"

    def __init__(self, k_of):
        self.k_of, self.step = k_of, 0

    def choose_ks(self, view):
        self.step += 1
        return [self.k_of(self.step, int(r.request_id.split("-")[-1]), view.k_max) for r in view.requests]


def MixedPolicy():
    """Different k per request and per step, 0 included."""
    return StepPolicy(lambda step, i, k_max: (step + i) % (k_max + 1))


def AlternatingPolicy():
    """k = K on even steps, 0 on odd ones: the draft must catch up on the tokens made at k = 0."""
    return StepPolicy(lambda step, i, k_max: k_max if step % 2 == 0 else 0)


def PricedGoodputPolicy(key: str = "t") -> GoodputPolicy:
    """The goodput policy with step costs fixed, never refitted from measured time: what it chooses then depends on
    the tokens alone (acceptance), not on how fast the machine ran, so a test of what it chose cannot turn on the
    box's speed. A target step of 20 ms and 1 ms a verified token, a draft forward of 2 ms: drafting pays for a
    request whose drafts are accepted, and not for one whose are all rejected. Run it with warmup_profile=False,
    or the warm-up profile refits the costs from the clock."""
    policy = GoodputPolicy(key=key, refit_every=2**62)
    policy.cost.v = [0.020, 0.001, 0.001, 0.001, 0.001, 0.001, 0.001, 0.0]
    policy.cost.d = [0.002, 0.0, 0.0]
    return policy


def run_staggered(llm, prompts, params):
    """Requests join at different steps (while others decode), and leave as they finish."""
    eng = llm.engine
    joins = {0: 0, 2: 1, 5: 2, 9: 3}
    ids, got, step = {}, {i: [] for i in range(len(prompts))}, 0
    while eng.has_unfinished() or step <= max(joins):
        if step in joins:
            i = joins[step]
            ids[eng.add_request(prompts[i], params[i], request_id=f"r-{i}")] = i
        for out in eng.step():
            got[ids[out.request_id]].extend(out.new_token_ids)
        step += 1
    return [got[i] for i in range(len(prompts))]


def make(path, spec=None, **kw):
    return LLM(path, num_kv_blocks=128, block_size=4, max_model_len=256, speculative_config=spec, **kw)


PARAMS = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (40, 25, 33, 12)]


# "self": the target drafts for itself, so every draft token is what plain decoding makes: verification accepts
# deep runs only if each row is reshaped (or masked) with the draft tokens before it
METHODS = ["ngram", "suffix", "draft_model", "self", "self-tree"]


def mixed_spec(method: str, target: str, draft: str) -> dict:
    """A speculative config of METHODS, with k changing per request and step (MixedPolicy)."""
    if method in ("ngram", "suffix"):
        return {"method": method, "num_speculative_tokens": 4, "policy": MixedPolicy()}
    spec = {"method": "draft_model", "num_speculative_tokens": 4, "policy": MixedPolicy(),
            "model": draft if method == "draft_model" else target}
    if method == "self-tree":
        spec["tree"] = {"max_nodes": 8, "max_depth": 3, "branching": 2}
    return spec
