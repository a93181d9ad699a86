"""A target stand-in whose forward returns its logits at once: what remains of a step is the engine's own host work
(scheduling, planning, input preparation, acceptance, commit), which scripts/bench_host.py measures.

The stand-in is a fixed, known model: after a token of `cycle` it prefers the next one (the last wraps to the
first), after any other token the cycle's first. So a prompt that runs through the cycle is continued by it, and
prompt lookup (ngram) drafts that are all accepted; sampling controls, grammars and logprobs act on real logits."""
from __future__ import annotations

import time

import torch

from smartspec.runtime.block_manager import BlockManager
from smartspec.runtime.model_runner import ForwardItem, prepare_step
from smartspec.runtime.step_inputs import StepInputs
from smartspec.types.padding import PaddedShapes

PREFERRED_LOGIT = 8.0  # the cycle's next token over 0 for every other: greedy and p ~ 0.99 at temperature 1 with V=257


class InstantRunner:
    """What the engine uses of a ModelRunner, with the runner's own input preparation (model_runner.prepare_step)
    and the cycle rule above for its model, no KV cache (the rule reads none). prepare_s and execute_s: the seconds
    its input preparation and its stand-in forward took. vocab_size: the logits' width (the model config's)."""

    padded_shapes: PaddedShapes | None = None  # every step runs as it comes, as on a CPU

    def __init__(self, vocab_size: int, blocks: BlockManager, cycle: list[int]) -> None:
        vocab = self.vocab_size = vocab_size
        self.blocks = blocks
        if not cycle or min(cycle) < 0 or max(cycle) >= vocab:
            raise ValueError(f"cycle must be token ids in [0, {vocab}), got {cycle!r}")
        self.next_token = torch.full((vocab,), cycle[0], dtype=torch.long)
        self.next_token[torch.tensor(cycle)] = torch.tensor(cycle[1:] + cycle[:1])
        self.prepare_s = self.execute_s = 0.0

    def close(self) -> None:
        """Nothing to stop."""

    def copy_kv(self, src_slots: list[int], dst_slots: list[int]) -> None:
        """A token tree's accepted path moved in the cache: the stand-in keeps none."""

    def forward(self, items: list[ForwardItem]) -> torch.Tensor:
        began = time.perf_counter()
        inputs = prepare_step(items, self.blocks)
        self.prepare_s += time.perf_counter() - began
        return self.execute(inputs)

    def execute(self, inputs: StepInputs) -> torch.Tensor:
        began = time.perf_counter()
        preferred = self.next_token[inputs.ids[inputs.keep]]
        logits = torch.zeros((len(preferred), self.vocab_size), dtype=torch.float32)
        logits[torch.arange(len(preferred)), preferred] = PREFERRED_LOGIT
        self.execute_s += time.perf_counter() - began
        return logits
