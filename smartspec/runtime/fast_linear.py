"""Swap a model's linears (and a tied embedding) for the batch-invariant kernels, keeping one copy of weights."""
from __future__ import annotations

import torch
from torch import nn


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, ext) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = nn.Parameter(ext.pack_weight(linear.weight.data), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.data, requires_grad=False)
        self._ext = ext

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._ext.linear(x.reshape(-1, self.in_features), self.packed, self.out_features, self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def weight_row(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the original [out, in] weight, read from the panels (for an embedding tied to this layer)."""
        return self.packed[ids // 16, :, ids % 16]


class PackedTiedEmbedding(nn.Module):
    def __init__(self, head: PackedLinear) -> None:
        super().__init__()
        self.head = [head]  # a list, so the head's parameters are not registered twice

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head[0].weight_row(ids)


def pack_linears(model: nn.Module, ext) -> int:
    """Replace every nn.Linear in place; return how many were replaced."""
    head = model.get_output_embeddings()
    embedding = getattr(model.get_input_embeddings(), "weight", None)  # none on a quantized embedding
    tied = embedding is not None and embedding is getattr(head, "weight", None)
    targets = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    for name, linear in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        packed = PackedLinear(linear, ext)
        setattr(parent, attr, packed)
        if tied and linear is head:
            model.set_input_embeddings(PackedTiedEmbedding(packed))
    return len(targets)
