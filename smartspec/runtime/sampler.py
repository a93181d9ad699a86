"""From logits to tokens: greedy, or temperature / top-k / top-p sampling with per-request generators, and seeded
requests' tokens from noise keyed by (seed, position)."""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from smartspec.runtime.upload import HostBatch
from smartspec.types.sampling_params import SamplingParams


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled request draws from: logits [..., V] -> probs after temperature, min-p, top-k,
    top-p. Speculative acceptance applies the same function to target and draft logits."""
    x = logits.float() / params.temperature
    if params.min_p > 0:  # relative to the most likely token: log p < log(min_p) + max log p
        floor = x.amax(dim=-1, keepdim=True) + math.log(params.min_p)
        x = x.masked_fill(x < floor, float("-inf"))
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # keep a token if the mass before it is below top_p (the most likely token is always kept)
        drop_sorted = (torch.cumsum(sorted_p, dim=-1) - sorted_p) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


class RowControls(NamedTuple):
    """The controls target_probs applies, per row of a batch of logits, on the rows' device (StagedRowControls,
    sent with a stage's other values): each row its own request's. A control no row uses is None, its operations
    skipped for the whole batch."""
    params: list[SamplingParams]  # per row: the request's (what the tensors were made from)
    temperature: torch.Tensor  # [R, 1]
    log_min_p: torch.Tensor | None  # [R, 1] log(min_p); -inf in a row without min_p (its floor is then -inf)
    top_k: torch.Tensor | None  # [R, 1] the index of the k-th largest value; -1 in a row without top_k
    max_top_k: int  # the largest top_k among the rows that use it
    top_p: torch.Tensor | None  # [R, 1]; +inf in a row without top_p (nothing dropped, nothing renormalised)


class StagedRowControls:
    """RowControls' values for rows of these params, gathered on the host and staged in a stage's HostBatch;
    `on` makes the RowControls from what the batch sent."""

    def __init__(self, params: list[SamplingParams], vocab: int, batch: HostBatch) -> None:
        self.params = params
        self.temperature = batch.floats([p.temperature for p in params])
        self.log_min_p = batch.floats([math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params]) \
            if any(p.min_p > 0 for p in params) else None
        top_ks = [p.top_k if p.top_k and p.top_k < vocab else 0 for p in params]
        self.max_top_k = max(top_ks, default=0)
        self.top_k = batch.ints([k - 1 for k in top_ks]) if self.max_top_k else None
        self.top_p = batch.floats([p.top_p if p.top_p < 1.0 else math.inf for p in params]) \
            if any(p.top_p < 1.0 for p in params) else None

    def on(self, sent: list[torch.Tensor]) -> RowControls:
        def column(key: int | None) -> torch.Tensor | None:
            return None if key is None else sent[key][:, None]
        return RowControls(self.params, column(self.temperature), column(self.log_min_p), column(self.top_k),
                           self.max_top_k, column(self.top_p))


def target_probs_rows(logits: torch.Tensor, controls: RowControls) -> torch.Tensor:
    """target_probs for a batch of rows [R, V], each with its own request's controls, in one pass: every row
    bitwise what target_probs gives it alone (the same operations, a row's own values in place of its request's
    numbers, each reduction within its row), so a request's distribution does not depend on its batch."""
    x = logits.float() / controls.temperature
    if controls.log_min_p is not None:
        x = x.masked_fill(x < x.amax(dim=-1, keepdim=True) + controls.log_min_p, float("-inf"))
    if controls.top_k is not None:
        kth = torch.topk(x, controls.max_top_k, dim=-1).values.gather(-1, controls.top_k.clamp(min=0))
        x = x.masked_fill((x < kth) & (controls.top_k >= 0), float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if controls.top_p is not None:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        drop_sorted = (torch.cumsum(sorted_p, dim=-1) - sorted_p) >= controls.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = torch.where(controls.top_p < 1.0, probs / probs.sum(dim=-1, keepdim=True), probs)
    return probs


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """torch.multinomial(probs, 1, generator=generator): a token per row of probs [..., V] (shape [..., 1]) by the
    same exponential race on the same stream (on a CPU, the same tokens), without multinomial's checks of its input:
    two host reads at every call (ATen's Distributions.cpp), each a wait for a GPU. The step checks its rows itself,
    in its one read: a row with no finite logit ends its request, whatever is drawn from it. An exponential draw of
    exactly 0 (p / 0: inf, or NaN at p = 0, which argmax would take) counts as the smallest normal float."""
    race = torch.empty_like(probs).exponential_(generator=generator).clamp_(min=torch.finfo(probs.dtype).tiny)
    return (probs / race).argmax(dim=-1, keepdim=True)


def draw_rows(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """[R] a token per row of probs [R, V], row i's from generators[i]: each run of rows sharing one generator in
    one draw (unseeded requests share the engine's), the same tokens as a draw a row, in order, on a CPU."""
    return torch.cat([draw(probs[start:end], gen).view(-1) for start, end, gen in _runs(generators)])


def uniforms(counts: list[int], generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """[sum(counts)] uniforms in [0, 1), counts[i] of them from generators[i], in order: each run sharing one
    generator in one draw (draw_rows' runs; on a CPU the same numbers as a draw each)."""
    return torch.cat([torch.rand(sum(counts[start:end]), generator=gen, device=device)
                      for start, end, gen in _runs(generators)])


def _runs(keys: list) -> list[tuple[int, int, object]]:
    """(start, end, key) of each run of consecutive equal keys (the same object)."""
    runs, start = [], 0
    for i in range(1, len(keys) + 1):
        if i == len(keys) or keys[i] is not keys[start]:
            runs.append((start, i, keys[start]))
            start = i
    return runs


_ARGMAX = object()  # draw_tokens' key of a row that keeps its argmax


def draw_tokens(logits: torch.Tensor, best: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None], probs: torch.Tensor | None = None) \
        -> tuple[torch.Tensor, dict[int, Exception]]:
    """One token per row of logits [R, V], left on the logits' device (the step reads its tokens back once, not a
    row at a time): best, the rows' argmax, for the greedy rows; each sampled row drawn from its own generator, from
    probs [R, V] where the rows' target probabilities were made together (target_probs_rows), else its own. Rows
    sharing a generator are drawn together (draw_rows), by slices of the rows: no index to send, nothing read.
    A row whose probabilities or draw raise keeps its argmax and is returned by row with its exception: one
    request's failure is its own, never its neighbours'."""
    failed: dict[int, Exception] = {}
    own: list[torch.Tensor | None] = [None] * len(params)
    for row, p in enumerate(params):
        if not p.greedy and probs is None:
            try:
                own[row] = target_probs(logits[row], p)
            except Exception as exc:
                failed[row] = exc
    keys = [_ARGMAX if p.greedy or row in failed else generators[row] for row, p in enumerate(params)]
    pieces = []
    for start, end, gen in _runs(keys):
        if gen is _ARGMAX:
            pieces.append(best[start:end])
            continue
        block = probs[start:end] if probs is not None else torch.stack(own[start:end])
        try:
            pieces.append(draw(block, gen).view(-1))
        except Exception:  # told apart row by row
            pieces.extend(_drawn_alone(block, best[start:end], gen, start, failed))
    # the rows' tokens in place, put together on the device
    return (torch.cat(pieces) if pieces else best), failed


def _drawn_alone(block: torch.Tensor, best: torch.Tensor, generator: torch.Generator | None, start: int,
                 failed: dict[int, Exception]) -> list[torch.Tensor]:
    """A run's rows drawn one at a time, a row whose draw raises keeping its argmax (entered in failed)."""
    out = []
    for i in range(len(block)):
        try:
            out.append(draw(block[i], generator))
        except Exception as exc:
            failed[start + i] = exc
            out.append(best[i:i + 1])
    return out


_MASK64 = (1 << 64) - 1
SEEDED_ROWS_AT_ONCE = 64  # seeded rows drawn in one pass (seeded_draws): 78 MB of noise at a 152k vocabulary


def noise_seed(seed: int, position: int) -> int:
    """A generator seed for the noise at one position of a seeded request: splitmix64 of (seed, position), so
    neighbouring seeds and positions get unrelated streams."""
    z = ((seed & _MASK64) * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def seeded_noise(seed: int, positions: list[int], vocab: int, device: torch.device | str) -> torch.Tensor:
    """[n, vocab] Exp(1) draws for a seeded request at these token positions (seeded_noise_rows)."""
    return seeded_noise_rows([(seed, pos) for pos in positions], vocab, device)


def seeded_noise_rows(keys: list[tuple[int, int]], vocab: int, device: torch.device | str) -> torch.Tensor:
    """[len(keys), vocab] Exp(1) draws, a row for each (seed, position), from a generator keyed by them alone,
    clamped away from 0 (p / 0 would be inf, or NaN for p = 0, which argmax would take). Each is -log(1 - U) of a
    float64 uniform U (53 bits, the inverse of Exp(1)'s distribution function): on a CPU a third of exponential_'s
    time over a 152k vocabulary (1.0 against 2.8 ms a position, a seeded request's every verified and drafted
    position). Rows of several requests are made together: a row's values are its key's whatever the others are
    (elementwise operations on its own uniforms), and the operations after the draws run once for all of them."""
    noise = torch.empty(len(keys), vocab, dtype=torch.float64, device=device)
    for row, (seed, pos) in zip(noise.unbind(0), keys):  # the rows' views in one operation, not one a row
        row.uniform_(generator=torch.Generator(device=device).manual_seed(noise_seed(seed, pos)))
    return noise.neg_().log1p_().neg_().to(torch.float32).clamp_(min=torch.finfo(torch.float32).tiny)


def seeded_tokens(probs: torch.Tensor, seed: int, positions: list[int]) -> torch.Tensor:
    """probs [n, V]: the distributions of a seeded request at these token positions. Its tokens by the Gumbel-max
    rule, argmax p / E with E = seeded_noise(seed, position): each token is an exact draw from p, and it depends on
    nothing but p, the seed and the position, not on what a proposer offered, on the batch or on how many uniforms
    anything drew before. So a seeded request repeats itself, and under speculation a draft token is accepted
    exactly where it equals this token (greedy verification against it). A draft model that draws its own tokens
    with the same noise (argmax q / E) proposes what the target will take wherever q and p agree."""
    return seeded_draws([probs], [(seed, pos) for pos in positions])


def seeded_draws(probs: list[torch.Tensor], keys: list[tuple[int, int]]) -> torch.Tensor:
    """seeded_tokens for rows of any seeded requests at once: probs, the rows' distributions in the order of keys,
    either all blocks [n_i, V] (a request's rows each) or all single rows [V]; row i's token by the noise of
    keys[i] = (seed, position), each the same token its request's rows alone give (a row's division and argmax read
    that row alone). Drawn in passes of at most SEEDED_ROWS_AT_ONCE rows, whole blocks each: the noise is float64,
    and 256 requests' five positions at once over a 152k vocabulary would be 1.6 GB of it."""
    passes, group, rows = [], [], 0
    for block in probs:
        n = 1 if block.dim() == 1 else len(block)
        if group and rows + n > SEEDED_ROWS_AT_ONCE:
            passes.append(group)
            group, rows = [], 0
        group.append(block)
        rows += n
    passes.append(group)
    drawn, at = [], 0
    for group in passes:
        p = torch.stack(group) if group[0].dim() == 1 else group[0] if len(group) == 1 else torch.cat(group)
        drawn.append((p / seeded_noise_rows(keys[at:at + len(p)], p.shape[-1], p.device)).argmax(dim=-1))
        at += len(p)
    return drawn[0] if len(drawn) == 1 else torch.cat(drawn)
