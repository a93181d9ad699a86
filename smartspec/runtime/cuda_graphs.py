"""Decode and verify steps replayed as CUDA graphs, in padded buckets.

An eager step of a small model on a GPU is bound by the host launching kernels (hundreds a step), not by the GPU;
a captured graph launches the whole step in one call. A graph replays fixed shapes at fixed addresses, so a step
that fits a bucket is laid out in static buffers as a grid of `rows` sequences x `width` query tokens, each row
attending the first `kv_width` positions of its cache: one query group of the torch attention path. Padding tokens
write their k/v to a scratch block no request owns (the runner allocates it past the block manager's blocks) and
their logits are dropped. A step with a prefill chunk (a sequence of more than LONG_QUERY tokens), or beyond the
largest bucket, runs eagerly.

The graph holds the decoder; the language-model head runs after it on the kept rows only, so a bucket's output is
its hidden states, not a vocabulary-wide row for every padding cell. Each bucket is captured the first time a step
needs it, and its first replay is checked against the eager run of the same padded inputs; a capture error or a
mismatch turns graphs off for the runner, with a warning, and steps run eagerly from then on. Without a GPU the
same padded steps run eagerly (`capture=False`): everything but the capture itself is exercised by the CPU
tests."""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from smartspec.runtime.attention import LONG_QUERY, NO_TREE, QueryGroup, StepAttention, lay_out, q_per_kv, set_step
from smartspec.runtime.backends import ModulesBackend
from smartspec.runtime.step_inputs import StepInputs
from smartspec.types.padding import PaddedShapes

logger = logging.getLogger(__name__)

# rows x width buckets; a step of one wider than 1024 cells is compute-bound, and graphs gain it little
GRAPH_SHAPES = PaddedShapes(rows=(1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256),
                            widths=(1, 2, 4, 8, 16, 32, LONG_QUERY), max_cells=1024)
MIN_KV_WIDTH = 128  # cache positions attended: a power of two from here, up to what the cache holds
MAX_GRAPHS = 48  # buckets captured per runner; a step of another bucket past this runs eagerly
MISMATCH = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 1e-2}  # replay vs eager, x the logit scale


@dataclass(frozen=True)
class Bucket:
    rows: int
    width: int
    kv_width: int
    trees: bool


def bucket_for(inputs: StepInputs, block_size: int, max_kv_width: int) -> Bucket | None:
    """The smallest bucket that holds the step, or None (a prefill chunk, too many rows, too long a context)."""
    counts = torch.bincount(inputs.seq_of)  # a sequence's tokens are contiguous, its row is seq_of
    kv = int(inputs.kv_len.max())
    shape = GRAPH_SHAPES.bucket(len(counts), int(counts.max()))
    if shape is None or kv > max_kv_width:
        return None
    rows, width = shape
    kv_width = min(max(MIN_KV_WIDTH, 1 << (kv - 1).bit_length()), max_kv_width)
    return Bucket(rows, width, -(-kv_width // block_size) * block_size, inputs.tree_base is not None)


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
        self.host = {  # staging: filled on the host each step, copied in one go (pinned memory on a GPU)
            "ids": torch.zeros(n, dtype=torch.int64), "positions": torch.zeros(n, dtype=torch.int64),
            "slots": torch.zeros(n, dtype=torch.int64), "kv_len": torch.ones(n, dtype=torch.int64),
            "block_tables": torch.zeros(bucket.rows, bucket.kv_width // block_size, dtype=torch.int64),
        }
        if bucket.trees:
            self.host["tree_base"] = torch.zeros(n, dtype=torch.int64)
            self.host["tree_mask"] = torch.zeros(n, dtype=torch.int64)
        if device.type == "cuda":
            self.host = {name: t.pin_memory() for name, t in self.host.items()}
        self.static = {name: torch.zeros_like(t, device=device) for name, t in self.host.items()}
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

    def load(self, inputs: StepInputs) -> torch.Tensor:
        """Lay the step out in the grid; return the grid cells of its kept rows (on the device)."""
        b, h = self.bucket, self.host
        if self.copied is not None:
            self.copied.synchronize()
        counts = torch.bincount(inputs.seq_of)
        first = counts.cumsum(0) - counts
        seq = inputs.seq_of.long()
        at = seq * b.width + torch.arange(len(seq)) - first[seq]  # each token's cell: its row, its column
        scratch_slot = self.scratch_block * self.block_size
        for name, pad, values in (("ids", 0, inputs.ids), ("positions", 0, inputs.positions),
                                  ("slots", scratch_slot, inputs.slots), ("kv_len", 1, inputs.kv_len),
                                  ("tree_base", NO_TREE, inputs.tree_base), ("tree_mask", 0, inputs.tree_mask)):
            if name in h:
                h[name].fill_(pad)
                h[name][at] = values.to(torch.int64)
        tables = h["block_tables"]
        tables.fill_(self.scratch_block)
        cols = min(tables.shape[1], inputs.block_tables.shape[1])
        tables[: len(counts), :cols] = inputs.block_tables[:, :cols]
        for name, t in h.items():
            self.static[name].copy_(t, non_blocking=True)
        if self.device.type == "cuda":
            self.copied = torch.cuda.Event()
            self.copied.record()
        return at[inputs.keep].to(self.device)

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
        the warm-up's hidden states, for the first replay's check. The buffers hold a real step: its k/v writes are
        rewritten with the same values by the replay that follows."""
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
    """Decode and verify steps through `PaddedStep`s (CUDA graphs when `capture`), every other step through `eager`.
    `max_kv_width`: the cache positions a sequence can reach (a multiple of block_size)."""
    uses_kernels = False

    def __init__(self, eager: ModulesBackend, block_size: int, scratch_block: int, max_kv_width: int,
                 capture: bool) -> None:
        self.eager, self.model, self.device = eager, eager.model, eager.device
        self.block_size, self.scratch_block, self.max_kv_width = block_size, scratch_block, max_kv_width
        self.capture = capture
        self.steps: dict[Bucket, PaddedStep] = {}
        self.enabled = True
        self.pool = None

    @property
    def padded_shapes(self) -> PaddedShapes | None:
        """The shapes steps run in, for the policy's pricing; None once graphs are off."""
        return GRAPH_SHAPES if self.enabled else None

    @property
    def name(self) -> str:
        return self.eager.name + ("" if not self.enabled else "+cuda-graphs" if self.capture else "+padded-steps")

    @torch.inference_mode()
    def execute(self, inputs: StepInputs, kv_caches) -> torch.Tensor:
        bucket = bucket_for(inputs, self.block_size, self.max_kv_width) if self.enabled else None
        if bucket is None:
            return self.eager.execute(inputs, kv_caches)
        step = self.steps.get(bucket)
        if step is not None:
            return step.run(step.load(inputs))  # load first: it fills the buffers the run reads
        if len(self.steps) >= MAX_GRAPHS:
            return self.eager.execute(inputs, kv_caches)
        logits = self._first_step(PaddedStep(self.model, kv_caches, bucket, self.device, self.block_size,
                                             self.scratch_block), inputs)
        return logits if logits is not None else self.eager.execute(inputs, kv_caches)

    def _first_step(self, step: PaddedStep, inputs: StepInputs) -> torch.Tensor | None:
        """A new bucket's first step: captured and checked, then kept for the steps after it; its logits. None, and
        graphs off, where capture fails or its replay disagrees with the eager run."""
        keep = step.load(inputs)
        if not self.capture:
            self.steps[step.bucket] = step
            return step.run(keep)
        try:
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            eager = step.logits(step.capture(self.pool), keep)
            replayed = step.run(keep)
            gap = float((replayed - eager).abs().max() / eager.abs().max().clamp(min=1.0))
            if not gap <= MISMATCH[next(self.model.parameters()).dtype]:
                raise RuntimeError(f"its replay differs from the eager step by {gap:.3g} x the logit scale")
        except Exception as exc:
            logger.warning("CUDA graphs turned off, steps run eagerly: capturing %s failed: %s", step.bucket, exc)
            self.enabled, self.steps = False, {}
            return None
        self.steps[step.bucket] = step
        return replayed
