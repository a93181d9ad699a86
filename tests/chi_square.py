"""Chi-square checks of sampled tokens against a target distribution (the lossless tests of sampled speculation)."""
import torch

# chi-square critical values at alpha = 1e-4, by degrees of freedom (support size - 1)
CHI2_CRIT_BY_DOF = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74, 6: 27.86, 7: 29.88}
CHI2_CRIT = CHI2_CRIT_BY_DOF[7]


def chi2(samples: list[int], p: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(samples), minlength=p.numel()).double()
    expected = p.double() * len(samples)
    assert counts[expected == 0].sum() == 0, "sampled a token the target gives probability 0"
    keep = expected > 0
    stat = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    return stat / CHI2_CRIT_BY_DOF[int(keep.sum()) - 1] * CHI2_CRIT  # scaled so one threshold fits every support
