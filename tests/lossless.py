"""Greedy equality with a reference, with the one caveat docs/architecture.md allows: two correct fp32 runs may part
at a near-tie of the reference's top-2 logits. A parting is accepted only if that gap is proven tiny."""
import torch

NEAR_TIE = 1e-3  # relative to the logit scale at that position


def assert_greedy_equal(ours: list[int], ref: list[int], prompt: list[int], ref_model) -> None:
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            with torch.no_grad():
                logits = ref_model(torch.tensor([prompt + ref[:i]])).logits[0, -1].float()
            top2 = torch.topk(logits, 2).values
            gap = float(top2[0] - top2[1])
            scale = float(logits.abs().max())
            assert gap < NEAR_TIE * scale, (
                f"outputs part at token {i} ({a} vs {b}) where the reference's top-2 gap is {gap:.3g} "
                f"(scale {scale:.3g}): not a near-tie, a bug")
            return
    assert len(ours) == len(ref), f"same tokens but lengths differ: {len(ours)} vs {len(ref)}"


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False)
    return out[0, len(prompt):].tolist()
