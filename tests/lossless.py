"""Greedy equality with a reference, with the one caveat docs/architecture.md allows: two correct fp32 runs may part
at a near-tie of the reference's top-2 logits. A parting is accepted only where it is proven to be one: the two
tokens are the reference's top two there and their gap is tiny; and every token of ours after it is checked too,
against the reference run on our own tokens."""
import torch

from smartspec.types.logprobs import TokenLogprob

NEAR_TIE = 1e-3  # relative to the logit scale at that position


def assert_greedy_equal(ours: list[int], ref: list[int], prompt: list[int], ref_model) -> None:
    if ours == ref:
        return
    parted = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
    assert parted is not None, f"same tokens but lengths differ: {len(ours)} vs {len(ref)}"
    with torch.no_grad():  # the reference on our tokens: the logits that chose each of them
        rows = ref_model(torch.tensor([prompt + ours])).logits[0, len(prompt) - 1:-1].float()
    for i, token in enumerate(ours):
        top = torch.topk(rows[i], 2)
        if token == int(top.indices[0]) and i != parted:
            continue
        gap, scale = float(top.values[0] - top.values[1]), float(rows[i].abs().max())
        pair = {int(t) for t in top.indices}
        tokens = {token, ref[i]} if i == parted else {token}
        assert tokens <= pair and gap < NEAR_TIE * scale, (
            f"token {i} ({token}{f' vs the reference {ref[i]}' if i == parted else ''}) is not a proven near-tie: "
            f"the reference's top two there are {sorted(pair)} with gap {gap:.3g} (scale {scale:.3g}): a bug")


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False)
    return out[0, len(prompt):].tolist()


def token_logprob(row: torch.Tensor, token_id: int, n: int) -> TokenLogprob:
    """The reference for a token's logprob: token_id under one row of logits [V] taken alone, with the n most
    likely alternatives (the engine computes a step's at once: engine/step_logprobs.py)."""
    logprobs = torch.log_softmax(row.float().contiguous(), dim=-1)
    value = logprobs[token_id]
    rank = int((logprobs > value).sum()) + 1
    top = ()
    if n:
        values, ids = torch.topk(logprobs, n)
        top = tuple(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token_id, float(value), rank, top)
