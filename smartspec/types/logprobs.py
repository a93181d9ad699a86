"""Log-probabilities of tokens under the target model: log-softmax of its raw logits (vLLM's default), before
temperature, top-k or top-p. A token's row of logits is the same bits whether it came from a plain decode, a
chunked prefill or a speculative verify (the kernels are batch-invariant), and each row is taken on its own, so
the values are the same with and without speculation."""
from __future__ import annotations

from dataclasses import dataclass
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: tuple[tuple[int, float], ...]  # the `n` most likely (token id, logprob), most likely first


def rows_of_new_tokens(num_new: int, tree_path: list[int] | None) -> list[int]:
    """Which of an item's logits rows predicted each of the step's new tokens: a chain's row j predicts token j;
    in a tree, token 0 comes from the root's row and token j from the row of the j-th accepted node."""
    if tree_path is None:
        return list(range(num_new))
    return [0] + [1 + node for node in tree_path[:num_new - 1]]
