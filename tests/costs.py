"""Synthetic step costs shared by the policy tests."""


def seen_verify(n, c):
    """What a policy that always drafted 5 tokens could have learned: tokens cheap, context dear."""
    return 0.10 + 0.005 * n + 0.0008 * c


def runs_verify(n, c):
    """What the steps cost: context free, tokens beyond 16 twice as dear. Equal to seen_verify at 5-token drafts for
    four requests of 110 tokens (24 tokens, 440 context), so running only those shapes cannot tell them apart."""
    return 0.092 + 0.015 * min(n, 16) + 0.03 * max(0, n - 16)


def draft_cost(depth, sum_k):
    return 0.06 * depth + 0.007 * sum_k


def true_verify(n, c):
    return 0.05 + 0.002 * n + 1e-5 * c + 0.004 * max(0, n - 16)


def linear_cost(v0, v1, d0=0.0, d1=0.0):
    """n counts every token of the step: the decodes and the drafts."""
    return lambda n, c, depth, sum_k: v0 + v1 * n + d0 * depth + d1 * sum_k
