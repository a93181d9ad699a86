"""target_probs_rows: a batch of rows, each with its own request's sampling controls, in one pass; every row bitwise
what target_probs gives it alone, whatever else the batch holds (what keeps a seeded request's tokens the same
under speculation and without it, and a sampled request's distribution its own)."""
import math

import numpy as np
import torch

from smartspec.runtime.sampler import StagedRowControls, target_probs, target_probs_rows
from smartspec.runtime.upload import HostBatch
from smartspec.types.sampling_params import SamplingParams

V = 97


def random_params(rng: np.random.Generator) -> SamplingParams:
    """Temperature alone or with min_p, top_k (also past the vocabulary) and top_p, in every combination."""
    extra = {}
    if rng.random() < 0.5:
        extra["min_p"] = float(rng.choice([0.01, 0.05, 0.2, 0.5]))
    if rng.random() < 0.5:
        extra["top_k"] = int(rng.choice([1, 2, 5, 40, V, 500]))
    if rng.random() < 0.5:
        extra["top_p"] = float(rng.choice([0.1, 0.5, 0.9, 0.999]))
    return SamplingParams(temperature=float(rng.choice([0.3, 0.7, 1.0, 1.3])), **extra)


def random_rows(rng: np.random.Generator, n: int) -> torch.Tensor:
    """Rows with ties (logits rounded to a coarse grid) and tokens held at -inf (a grammar's or min_tokens' mask)."""
    rows = torch.from_numpy(np.round(rng.normal(0, 3, (n, V)) * 2) / 2).float()
    rows[torch.from_numpy(rng.random((n, V)) < 0.2)] = float("-inf")
    rows[:, 0] = 1.0  # every row keeps a finite logit
    return rows


def batched(rows: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    batch = HostBatch()
    staged = StagedRowControls(params, rows.shape[1], batch)
    return target_probs_rows(rows, staged.on(batch.send(rows.device)))


def test_each_row_of_a_batch_is_bitwise_its_request_alone():
    rng = np.random.default_rng(0)
    checked = 0
    for _ in range(150):
        requests = [(random_params(rng), int(rng.integers(1, 5))) for _ in range(int(rng.integers(1, 7)))]
        params = [p for p, n in requests for _ in range(n)]
        rows = random_rows(rng, len(params))
        got = batched(rows, params)
        at = 0
        for p, n in requests:
            alone = target_probs(rows[at:at + n], p)
            assert torch.equal(got[at:at + n], alone), (p, n)
            at += n
            checked += n
        assert torch.allclose(got.sum(dim=-1), torch.ones(len(params)))
    assert checked > 300


def test_a_control_no_row_uses_is_skipped_and_a_row_without_one_is_untouched():
    """A batch where one row uses top_p and top_k: the other row (temperature alone) is its plain softmax, not
    renormalised or cut (its top_p is +inf, its top_k index -1)."""
    rows = random_rows(np.random.default_rng(1), 2)
    plain, cut = SamplingParams(temperature=0.8), SamplingParams(temperature=0.8, top_p=0.5, top_k=3)
    got = batched(rows, [plain, cut])
    assert torch.equal(got[0], torch.softmax(rows[0] / 0.8, dim=-1))
    assert int((got[1] > 0).sum()) <= 3
    batch = HostBatch()
    staged = StagedRowControls([plain, plain], V, batch)
    assert staged.log_min_p is None and staged.top_k is None and staged.top_p is None
    assert math.isclose(float(batch.send(torch.device("cpu"))[staged.temperature][0]), 0.8, rel_tol=1e-7)
