"""A smaller model with the same tokenizer drafts tokens, in k_max lockstep steps over the requests that want them.

The draft keeps its own paged KV cache. Its per-request state is a `Request` mirroring the target's tokens; before
proposing it catches up on every token it has not seen (the target's bonus token, tokens produced while the request
ran at k = 0, everything after a preemption), found as the longest common prefix of what it holds and what the
target committed. Rejected drafts are dropped by truncating to that prefix."""
from __future__ import annotations

import logging

import torch

from smartspec.models import load_model
from smartspec.runtime.block_manager import BlockManager
from smartspec.runtime.logits_controls import ControlledRows, reshape_rows
from smartspec.runtime.model_runner import ForwardItem, ModelRunner
from smartspec.runtime.sampler import draw_rows, seeded_draws, target_probs
from smartspec.spec_decode.draft_runtime import DraftRuntime
from smartspec.spec_decode.draft_sampling import DraftSampling
from smartspec.spec_decode.proposer import Proposal, Proposer
from smartspec.types.request import Request

logger = logging.getLogger(__name__)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


# A long unseen context is read in pieces of this many tokens, as the target prefills: one forward over the whole
# costs the draft about 1.4x the pieces on a CPU (docs/policy.md, "Draft catch-up").
CATCHUP_CHUNK = 256


class DraftModelProposer(Proposer):
    method = "draft_model"

    def __init__(self, model: str, runtime: DraftRuntime, quantization: str | None = None) -> None:
        """model: the draft's name or folder; runtime: the target's vocabulary and the engine's runtime options;
        quantization: the draft's own (None: the runtime's, the target's)."""
        loaded = load_model(model, runtime.dtype, runtime.device, quantization=quantization or runtime.quantization)
        if loaded.tokenizer.get_vocab() != runtime.target_tokenizer.get_vocab():
            raise ValueError(f"draft model {model!r} does not share the target's tokenizer; "
                             "draft and target must use the same vocabulary")
        self.model = loaded.model
        self.target_vocab_size = runtime.target_vocab_size
        self.blocks = BlockManager(runtime.num_blocks, runtime.block_size, runtime.enable_prefix_caching)
        self.runner = ModelRunner(self.model, self.blocks, runtime.use_kernels, runtime.device,
                                  step_graphs="cuda" if runtime.bucket_limits is not None else "off",
                                  bucket_limits=runtime.bucket_limits)
        self.state: dict[str, Request] = {}
        # request -> the tokens of its context the prefix cache held when the policy first asked, until the draft
        # reads it: asked at every full plan, looked up in the cache once (its blocks hashed)
        self._cached_at_start: dict[str, int] = {}
        self._synced: dict[str, int] = {}  # request -> its leading tokens the draft's state shares (_sync_state)

    @property
    def draft_available(self) -> bool:
        return self.available

    def _sync_state(self, req: Request) -> Request:
        """The draft's state of `req`, its tokens made the target's. A target request's tokens are only appended
        to, so the draft's agree with them up to where the two were last made equal (`_synced`): only the tokens
        past that are compared (the drafts appended since, against the target's new tokens) and replaced, the same
        work whatever the context's length."""
        ds = self.state.get(req.request_id)
        if ds is None:
            ds = self.state[req.request_id] = Request(req.request_id, req.prompt_token_ids, req.params)
            self._cached_at_start.pop(req.request_id, None)
        known = self._synced.get(req.request_id, 0)
        if known > min(len(ds.token_ids), len(req.token_ids)):  # not the request it was synced to: from the start
            known = 0
        common = known + _common_prefix(ds.token_ids[known:], req.token_ids[known:])
        valid = min(ds.num_computed_tokens, common)
        self.blocks.truncate(ds, valid)
        ds.token_ids[common:] = req.token_ids[common:]
        self._synced[req.request_id] = len(ds.token_ids)
        if not ds.block_table:  # new, or every token rejected: start from the cached blocks of its prefix
            self.blocks.match_prefix(ds, ds.num_tokens - 1)
        self.blocks.register(ds, valid)  # the target committed these: they are never rewritten
        return ds

    def held_tokens(self, requests: list[Request]) -> list[int]:
        known, state = self._cached_at_start, self.state
        out = []
        for req in requests:
            rid = req.request_id
            if (ds := state.get(rid)) is not None:  # its drafts past the target's context are not the context's
                n = min(ds.num_computed_tokens, req.num_tokens - 1)
            elif (n := known.get(rid)) is None:
                n = known[rid] = self.blocks.cached_tokens(req.token_ids, req.num_tokens - 1)
            out.append(n)
        return out

    def sync(self, request: Request) -> None:
        if request.request_id in self.state:
            self._sync_state(request)

    def release(self, request_id: str) -> None:
        self._cached_at_start.pop(request_id, None)
        self._synced.pop(request_id, None)
        ds = self.state.pop(request_id, None)
        if ds is not None:
            self.blocks.free(ds)

    def _fit_vocab(self, q: torch.Tensor) -> torch.Tensor:
        """Models of one tokenizer may pad their vocabularies differently; q must cover the target's."""
        v = self.target_vocab_size
        if q.shape[-1] < v:
            return torch.nn.functional.pad(q, (0, v - q.shape[-1]))
        return q if q.shape[-1] == v else q[..., :v] / q[..., :v].sum()

    def _draw(self, live: list[tuple[int, Request, int]], requests: list[Request], logits: torch.Tensor,
              reshaped: dict[int, torch.Tensor], made: dict[int, torch.Tensor],
              probs: list[list[torch.Tensor] | None]) -> torch.Tensor:
        """A depth's tokens, one a row of `live`, on the device: greedy rows' argmax in one pass over the model's
        rows (a row its controls reshaped takes its own), seeded rows drawn together with the noise the target's
        token will be drawn with there (seeded_draws), the others each from its own generator, rows sharing one
        drawn together (draw_rows: unseeded requests share the engine's). Each sampled row's distribution q is
        kept in probs."""
        own: list[torch.Tensor | None] = []  # a row's own token (None: the argmax over the model's rows)
        seeded: list[tuple[int, torch.Tensor, tuple[int, int]]] = []  # (row, q, its noise's key)
        unseeded: list[tuple[int, torch.Tensor, torch.Generator | None]] = []  # (row, q, its generator)
        for row, (i, ds, _) in enumerate(live):
            req = requests[i]
            if req.params.greedy:
                own.append(reshaped[row].argmax().view(1) if row in reshaped else None)
                continue
            q = self._fit_vocab(made[row] if row in made else target_probs(reshaped.get(row, logits[row]), req.params))
            probs[i].append(q)
            if req.params.seed is not None:
                seeded.append((row, q, (req.params.seed, ds.num_tokens)))
                own.append(None)  # filled below, drawn with the other seeded rows
            else:
                unseeded.append((row, q, req.generator))
                own.append(None)  # filled below, drawn with the other unseeded rows
        if seeded:
            tokens = seeded_draws([q for _, q, _ in seeded], [key for _, _, key in seeded])
            for (row, _, _), token in zip(seeded, tokens.split(1)):
                own[row] = token
        if unseeded:
            tokens = draw_rows(torch.stack([q for _, q, _ in unseeded]), [g for _, _, g in unseeded])
            for (row, _, _), token in zip(unseeded, tokens.split(1)):
                own[row] = token
        if own and all(t is not None for t in own):  # every row has its own token: no argmax over all rows
            return torch.cat(own)
        best = logits.argmax(dim=-1)
        if all(t is None for t in own):
            return best
        # consecutive rows taking best's tokens as one slice
        pieces, start = [], 0
        for row, token in enumerate(own):
            if token is not None:
                pieces += [best[start:row], token] if row > start else [token]
                start = row + 1
        return torch.cat(pieces + [best[start:]])

    def _catch_up_in_chunks(self, states: list) -> None:
        """Reads each long unseen context in pieces of CATCHUP_CHUNK tokens, leaving at most that many (the last
        one among them) to the first drafting forward."""
        for ds in states:
            while ds.num_tokens - ds.num_computed_tokens > CATCHUP_CHUNK:
                start = ds.num_computed_tokens
                self.runner.forward([ForwardItem(ds, ds.token_ids[start:start + CATCHUP_CHUNK], start, 1)])
                ds.num_computed_tokens = start + CATCHUP_CHUNK

    @torch.inference_mode()
    def propose(self, requests: list[Request], ks: list[int], methods: list[str] | None = None) -> Proposal:
        tokens: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor] | None] = [None if r.params.greedy else [] for r in requests]
        live = []
        for i, (req, k) in enumerate(zip(requests, ks)):
            if k <= 0:
                continue
            ds = self._sync_state(req)
            # room for the catch-up tokens and k - 1 fed drafts; if the draft's cache is full, no speculation
            if not self.blocks.can_hold(ds, req.num_tokens + k - 1):
                continue
            self.blocks.allocate(ds, req.num_tokens + k - 1)
            live.append((i, ds, k))
        depth = 0
        catchup = sum(ds.num_tokens - ds.num_computed_tokens - 1 for _, ds, _ in live)
        self._catch_up_in_chunks([ds for _, ds, _ in live])
        sampling = None  # the sampled rows' controls, staged once the first forward gives the logits' width
        while live:
            # first step: every unseen token (catch-up); later steps: the previous draft token
            items = [ForwardItem(ds, ds.token_ids[ds.num_computed_tokens:], ds.num_computed_tokens, 1)
                     for _, ds, _ in live]
            logits = self.runner.forward(items)
            if sampling is None:
                sampling = DraftSampling(live, requests, logits.shape[-1], logits.device)
            reshaped = _controlled_rows(logits, live, requests)
            made = sampling.probs(depth, logits, reshaped)  # the depth's sampled rows' distributions, together
            for _, ds, _ in live:
                ds.num_computed_tokens = ds.num_tokens
            # each row's token, left on the device: the depth's tokens come to the host in one read
            drawn = self._draw(live, requests, logits, reshaped, made, probs)
            for (i, ds, _), tok in zip(live, drawn.tolist()):
                tokens[i].append(tok)
                ds.token_ids.append(tok)
            depth += 1
            live = [(i, ds, k) for i, ds, k in live if k > depth]
        return Proposal(tokens, [torch.stack(p) if p else None for p in probs], catchup_tokens=catchup)


def _controlled_rows(logits: torch.Tensor, live: list[tuple[int, Request, int]], requests: list[Request]) \
        -> dict[int, torch.Tensor]:
    """The rows of requests whose sampling controls reshape their logits, reshaped as the target's will be (drafts
    that follow the target's controls are accepted more), all in one pass, by row."""
    rows = [row for row, (i, _, _) in enumerate(live) if requests[i].params.reshapes_logits]
    if not rows:
        return {}
    controls = [ControlledRows(requests[live[row][0]].params, requests[live[row][0]].prompt_token_ids,
                               live[row][1].output_token_ids, [[]]) for row in rows]
    return dict(zip(rows, reshape_rows(logits, controls, rows=rows)))
