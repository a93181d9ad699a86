"""How a model runner executes a step's packed inputs on its device: the seam where device backends plug in.

A backend takes `StepInputs` (token ids, positions, cache slots, block tables; model_runner.py) and the paged KV
cache, and returns the fp32 logits of the rows the step keeps. Today's backends:

- `FusedKernelBackend`: Llama-family layers on int8 GGUF weights, one CPU kernel call per decoder layer.
- `ModulesBackend`: transformers' modules as written, attention through the paged cache (attention.py) on the CPU
  kernels where they load, else on torch's scaled-dot-product attention over query groups (any device); on a GPU
  each RMSNorm in one kernel (fused_norms.py).

`select_backend` picks the fastest that runs the model on its device and dtype."""
from __future__ import annotations

import logging
from typing import Protocol

import torch

from smartspec.runtime import attention, kernels
from smartspec.runtime.fast_linear import pack_linears
from smartspec.runtime.fused_decoder import FusedDecoder
from smartspec.runtime.fused_norms import fuse_rms_norms
from smartspec.runtime.step_inputs import StepInputs
from smartspec.runtime.upload import upload

logger = logging.getLogger(__name__)

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: [num_blocks, block_size, kv_heads, head_dim]


class Backend(Protocol):
    name: str
    uses_kernels: bool  # whether the CPU kernels compute it (they are batch-invariant: see docs/architecture.md)

    def execute(self, inputs: StepInputs, kv_caches: KVCaches) -> torch.Tensor:
        """logits [kept rows, vocab] (fp32) of one step; writes the step's k/v into kv_caches."""


class FusedKernelBackend:
    name = "fused-cpu-kernels"
    uses_kernels = True

    def __init__(self, fused: FusedDecoder) -> None:
        self.fused = fused

    def execute(self, inputs: StepInputs, kv_caches: KVCaches) -> torch.Tensor:
        return self.fused(inputs, kv_caches)


class ModulesBackend:
    def __init__(self, model: torch.nn.Module, device: torch.device, uses_kernels: bool) -> None:
        self.model, self.device, self.uses_kernels = model, device, uses_kernels
        self.q_per_kv = attention.q_per_kv(model.config)
        self.name = "transformers-modules" + ("+cpu-kernels" if uses_kernels else "")
        model.config._attn_implementation = attention.ATTN_IMPLEMENTATION
        if device.type == "cuda" and fuse_rms_norms(model):  # on a CPU, the kernels or the tests' reference path
            self.name += "+fused-norms"

    @torch.inference_mode()
    def execute(self, inputs: StepInputs, kv_caches: KVCaches) -> torch.Tensor:
        # the query groups are found on the host, then sent with the step's inputs in one copy (runtime/upload.py)
        groups = [] if self.uses_kernels else attention.group_queries(
            inputs.seq_of, inputs.kv_len, inputs.block_tables, inputs.tree_base, inputs.tree_mask)
        sent = upload([inputs.ids, inputs.positions, inputs.slots, inputs.block_tables, inputs.seq_of, inputs.kv_len,
                       inputs.keep, inputs.tree_base, inputs.tree_mask, *(a for g in groups for a in g.arrays())],
                      self.device)
        ids, positions, slots, block_tables, seq_of, kv_len, keep, tree_base, tree_mask = sent[:9]
        per_group = len(groups[0].arrays()) if groups else 0
        groups = [g.with_arrays(sent[9 + i * per_group:9 + (i + 1) * per_group]) for i, g in enumerate(groups)]
        attention.set_step(attention.StepAttention(
            kv_caches=kv_caches, slots=slots, block_tables=block_tables, seq_of=seq_of, kv_len=kv_len,
            use_kernels=self.uses_kernels, tree_base=tree_base, tree_mask=tree_mask,
            layouts=None if self.uses_kernels else [attention.lay_out(g, kv_caches[0][0].shape[1], self.q_per_kv)
                                                    for g in groups]))
        try:
            out = self.model(input_ids=ids[None], position_ids=positions[None], use_cache=False,
                             logits_to_keep=keep)
        finally:
            attention.set_step(None)
        return out.logits[0].float()


def select_backend(model: torch.nn.Module, device: torch.device, use_kernels: bool, tp_size: int = 1) -> Backend:
    """The CPU kernels where asked for and they load (fp32 activations on the CPU); the fused layers where the
    model's are Llama-family on int8 GGUF weights and it is not sharded; else transformers' modules."""
    dtype = next(model.parameters()).dtype
    ext = kernels.load() if use_kernels and device.type == "cpu" and dtype == torch.float32 else None
    if ext is None:
        if use_kernels:
            logger.warning("batch-invariant kernels not used (%s); running transformers' linears",
                           kernels.unavailable_reason() or f"{device.type}/{dtype}")
        return ModulesBackend(model, device, uses_kernels=False)
    pack_linears(model, ext)
    fused = FusedDecoder.build(model, ext) if tp_size == 1 else None
    return FusedKernelBackend(fused) if fused is not None else ModulesBackend(model, device, uses_kernels=True)
