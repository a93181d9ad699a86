"""Decode and verify steps replayed as CUDA graphs, in padded buckets.

An eager step of a small model on a GPU is bound by the host launching kernels (hundreds a step), not by the GPU;
a captured graph launches the whole step in one call. A graph replays fixed shapes at fixed addresses, so a step
that fits a bucket is laid out in static buffers as a grid of `rows` sequences x `width` query tokens, each row
attending the first `kv_width` positions of its cache: one query group of the torch attention path. Padding tokens
write their k/v to a scratch block no request owns (the runner allocates it past the block manager's blocks) and
their logits are dropped. The buckets are planned from the configuration (runtime/graph_buckets.py) so that every
decode and verify step has one; a step with a row wider than that (a prefill chunk) runs eagerly.

The graph holds the decoder; the language-model head runs after it on the kept rows only, so a bucket's output is
its hidden states, not a vocabulary-wide row for every padding cell. Every bucket is captured at start (`warm_up`),
largest first, and its first replay checked against the eager run of the same padded inputs; nothing is captured
while serving. A capture error or a mismatch turns graphs off for the runner, with a warning, and steps run eagerly
from then on. Without a GPU the same padded steps run eagerly (`capture=False`): everything but the capture itself
is exercised by the CPU tests."""
from __future__ import annotations

import logging
import math
import time
from collections import Counter
from dataclasses import replace

import torch

from smartspec.runtime.attention import NO_TREE, QueryGroup, StepAttention, lay_out, q_per_kv, set_step
from smartspec.runtime.backends import ModulesBackend
from smartspec.runtime.graph_buckets import Bucket, BucketPlan
from smartspec.runtime.step_inputs import StepInputs
from smartspec.types.padding import PaddedShapes

logger = logging.getLogger(__name__)

MISMATCH = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 1e-2}  # replay vs eager, x the hidden scale


def _views(block: torch.Tensor, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Named views of consecutive parts of one flat tensor."""
    views, at = {}, 0
    for name, shape in shapes.items():
        views[name] = block[at:at + math.prod(shape)].view(shape)
        at += math.prod(shape)
    return views


def bucket_for(inputs: StepInputs, plan: BucketPlan) -> Bucket | None:
    """The smallest planned bucket that holds the step, or None (a row wider than the plan's widest: a prefill)."""
    counts = torch.bincount(inputs.seq_of)  # a sequence's tokens are contiguous, its row is seq_of
    return plan.bucket(len(counts), int(counts.max()), int(inputs.kv_len.max()), inputs.tree_base is not None)


def graphable(model: torch.nn.Module) -> bool:
    """Whether the model splits into a decoder and a plain linear head (transformers' causal LMs do; a head that
    caps or scales its logits is left to the eager path)."""
    cfg = model.config
    return (isinstance(model.get_output_embeddings(), torch.nn.Linear) and model.get_decoder() is not model
            and not getattr(cfg, "final_logit_softcapping", None) and getattr(cfg, "logit_scale", 1.0) in (1.0, None))


class PaddedStep:
    """One bucket's static buffers, and the forward over them (captured as a graph on a GPU)."""

    def __init__(self, model: torch.nn.Module, kv_caches, bucket: Bucket, device: torch.device, block_size: int,
                 scratch_block: int) -> None:
        self.decoder, self.head = model.get_decoder(), model.get_output_embeddings()
        self.bucket, self.device = bucket, device
        self.block_size, self.scratch_block = block_size, scratch_block
        n = bucket.rows * bucket.width
        grid = (bucket.rows, bucket.width, 1)
        shapes = {"ids": (n,), "positions": (n,), "slots": (n,), "kv_len": (n,),
                  "block_tables": (bucket.rows, bucket.kv_width // block_size), "keep": (n,)}
        if bucket.trees:
            shapes.update(tree_base=(n,), tree_mask=(n,))
        # staging, filled on the host each step, and the graph's buffers: each one int64 block, so a step's inputs
        # go over in one copy (pinned memory on a GPU: it does not block the host)
        size = sum(math.prod(shape) for shape in shapes.values())
        self.host_block = torch.zeros(size, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.static_block = torch.zeros(size, dtype=torch.int64, device=device)
        self.host, self.static = _views(self.host_block, shapes), _views(self.static_block, shapes)
        s = self.static
        self.attention = StepAttention(
            kv_caches=kv_caches, slots=s["slots"], block_tables=s["block_tables"],
            seq_of=torch.arange(bucket.rows, device=device, dtype=torch.int32).repeat_interleave(bucket.width),
            kv_len=s["kv_len"], use_kernels=False, tree_base=s.get("tree_base"), tree_mask=s.get("tree_mask"))
        # the grid is the step's whole query group, its tokens in order (load lays them out so)
        self.group = QueryGroup(None, None, bucket.rows, bucket.width, bucket.kv_width, s["block_tables"],
                                s["kv_len"].view(grid), s["tree_base"].view(grid) if bucket.trees else None,
                                s["tree_mask"].view(grid) if bucket.trees else None)
        self.q_per_kv = q_per_kv(model.config)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.hidden: torch.Tensor | None = None  # the graph's output buffer [rows * width, hidden]
        self.copied: torch.cuda.Event | None = None  # the last step's staging copies (the buffers are reused)

    def load(self, inputs: StepInputs | None) -> torch.Tensor:
        """Lay the step out in the grid (None: padding only, the start's capture); return the grid cells of its
        kept rows (on the device)."""
        b, h = self.bucket, self.host
        if self.copied is not None:
            self.copied.synchronize()
        scratch_slot = self.scratch_block * self.block_size
        for name, pad in (("ids", 0), ("positions", 0), ("slots", scratch_slot), ("kv_len", 1),
                          ("tree_base", NO_TREE), ("tree_mask", 0)):
            if name in h:
                h[name].fill_(pad)
        h["block_tables"].fill_(self.scratch_block)
        kept = 0
        if inputs is not None:
            counts = torch.bincount(inputs.seq_of)
            first = counts.cumsum(0) - counts
            seq = inputs.seq_of.long()
            at = seq * b.width + torch.arange(len(seq)) - first[seq]  # each token's cell: its row, its column
            for name, values in (("ids", inputs.ids), ("positions", inputs.positions), ("slots", inputs.slots),
                                 ("kv_len", inputs.kv_len), ("tree_base", inputs.tree_base),
                                 ("tree_mask", inputs.tree_mask)):
                if name in h and values is not None:  # a chain step in a tree bucket keeps the padding's NO_TREE
                    h[name][at] = values.to(torch.int64)
            cols = min(h["block_tables"].shape[1], inputs.block_tables.shape[1])
            h["block_tables"][: len(counts), :cols] = inputs.block_tables[:, :cols]
            kept = len(inputs.keep)
            h["keep"][:kept] = at[inputs.keep]
        self.static_block.copy_(self.host_block, non_blocking=True)
        if self.device.type == "cuda":
            self.copied = torch.cuda.Event()
            self.copied.record()
        return self.static["keep"][:kept]

    def forward(self) -> torch.Tensor:
        """The decoder over the static buffers: every grid cell's last hidden state [rows * width, hidden]."""
        # laid out inside the forward, so a captured graph recomputes the slots and mask from each step's buffers
        set_step(replace(self.attention, layouts=[lay_out(self.group, self.block_size, self.q_per_kv)]))
        try:
            out = self.decoder(input_ids=self.static["ids"][None], position_ids=self.static["positions"][None],
                               use_cache=False)
        finally:
            set_step(None)
        return out.last_hidden_state[0]

    def logits(self, hidden: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """fp32 logits of the kept cells, as the model's own head computes them."""
        return self.head(hidden[keep]).float()

    def capture(self, pool) -> torch.Tensor:
        """Record the forward into a graph (after two eager warm-up runs on a side stream, as capture needs); return
        the warm-up's hidden states, for the first replay's check. The buffers hold padding: its k/v writes go to
        the scratch block only."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                eager = self.forward()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            self.hidden = self.forward()
        self.graph = graph
        return eager

    def run(self, keep: torch.Tensor) -> torch.Tensor:
        """The loaded step's kept logits."""
        if self.graph is None:
            return self.logits(self.forward(), keep)
        self.graph.replay()
        return self.logits(self.hidden, keep)


class GraphBackend:
    """Decode and verify steps through `PaddedStep`s, one per bucket of `plan` (CUDA graphs when `capture`), every
    other step through `eager`. Call `warm_up` once the KV caches exist, before the first step."""
    uses_kernels = False

    def __init__(self, eager: ModulesBackend, plan: BucketPlan, block_size: int, scratch_block: int,
                 capture: bool) -> None:
        self.eager, self.model, self.device = eager, eager.model, eager.device
        self.plan, self.block_size, self.scratch_block = plan, block_size, scratch_block
        self.capture = capture
        self.steps: dict[Bucket, PaddedStep] = {}
        self.uses: Counter[Bucket] = Counter()  # steps run in each bucket
        self.enabled = True

    @property
    def padded_shapes(self) -> PaddedShapes | None:
        """The shapes steps run in, for the policy's pricing; None once graphs are off."""
        return self.plan.shapes if self.enabled else None

    @property
    def name(self) -> str:
        return self.eager.name + ("" if not self.enabled else "+cuda-graphs" if self.capture else "+padded-steps")

    @torch.inference_mode()
    def warm_up(self, kv_caches) -> None:
        """Every bucket of the plan, largest first: captured and checked against its eager run (`capture`), or set
        up to run padded. A failure turns graphs off, with a warning: steps then run eagerly."""
        began, pool = time.perf_counter(), None
        for bucket in self.plan.buckets():
            step = PaddedStep(self.model, kv_caches, bucket, self.device, self.block_size, self.scratch_block)
            if self.capture:
                try:
                    pool = pool if pool is not None else torch.cuda.graph_pool_handle()
                    _capture_checked(step, pool, next(self.model.parameters()).dtype)
                except Exception as exc:
                    logger.warning("CUDA graphs turned off, steps run eagerly: capturing %s failed: %s", bucket, exc)
                    self.enabled, self.steps = False, {}
                    return
            self.steps[bucket] = step
        logger.info("%s: %d step buckets %s in %.1f s (rows %s, widths %s, kv widths %s, trees %s)",
                    self.name, len(self.steps), "captured" if self.capture else "laid out",
                    time.perf_counter() - began, self.plan.rows, self.plan.widths, self.plan.kv_widths,
                    self.plan.trees)

    @torch.inference_mode()
    def execute(self, inputs: StepInputs, kv_caches) -> torch.Tensor:
        bucket = bucket_for(inputs, self.plan) if self.enabled else None
        step = self.steps.get(bucket) if bucket is not None else None
        if step is None:
            return self.eager.execute(inputs, kv_caches)
        self.uses[bucket] += 1
        return step.run(step.load(inputs))  # load first: it fills the buffers the run reads


def _capture_checked(step: PaddedStep, pool, dtype: torch.dtype) -> None:
    """Capture a bucket on padding alone and check its replay against the eager run of the same inputs (every
    padding cell computes the same values, so their k/v writes to the scratch slot agree whichever lands last)."""
    step.load(None)
    eager = step.capture(pool)
    step.graph.replay()
    gap = float((step.hidden - eager).abs().max() / eager.abs().max().clamp(min=1.0))
    if not gap <= MISMATCH[dtype]:
        raise RuntimeError(f"its replay differs from the eager step by {gap:.3g} x the hidden scale")
