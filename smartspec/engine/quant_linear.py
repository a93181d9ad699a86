"""A linear layer that keeps GGUF weights quantized and computes from them (engine/kernels/quant_linear.cpp).

Its output is bitwise that of the fp32 panel kernel on the dequantized weight, so it is batch-invariant and
lossless for speculative verification exactly as the fp32 path is; only the memory it streams differs."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from smartspec.models.gguf_blocks import QuantizedRows

PANEL = 16  # output rows per panel, as the kernel's fp32 weights


def _panels(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """Rows [N, C] -> panels [ceil(N / 16), C, 16] (rows padded with zeros), the layout the kernel streams."""
    n, c = a.shape
    padded = np.zeros((-(-n // PANEL) * PANEL, c), dtype=a.dtype)
    padded[:n] = a
    out = padded.reshape(-1, PANEL, c).transpose(0, 2, 1)
    return torch.from_numpy(np.ascontiguousarray(out)).to(dtype)


def _nibble_panels(q: np.ndarray) -> torch.Tensor:
    """Codes 0..15 [N, K] -> byte panels [P, K / 2, 16] holding q[k] | q[k + 1] << 4."""
    pairs = q.astype(np.uint8).reshape(q.shape[0], -1, 2)
    return _panels(pairs[:, :, 0] | (pairs[:, :, 1] << 4), torch.uint8)


class QuantLinear(nn.Module):
    def __init__(self, rows: QuantizedRows, ext, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = rows.shape
        self.kind, self.group, self.superblock, self.nibble = rows.kind, rows.group, rows.superblock, rows.nibble
        # buffers, not parameters: the model's parameters stay fp32 (the runner reads its dtype from them)
        self.register_buffer("q", _nibble_panels(rows.q) if rows.nibble else _panels(rows.q, torch.int8))
        self.register_buffer("d", _panels(rows.d, torch.float32))
        self.register_buffer("sc", None if rows.sc is None else _panels(rows.sc, torch.int8))
        self.register_buffer("off", None if rows.off is None else _panels(rows.off, torch.float32))
        self.register_buffer("mn", None if rows.mn is None else _panels(rows.mn, torch.int8))
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self._ext = ext

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._ext.quant_linear(x.reshape(-1, self.in_features), self.q, self.d, self.sc, self.off, self.mn,
                                   self.out_features, self.group, self.superblock, self.nibble, self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{self.kind}, in_features={self.in_features}, out_features={self.out_features}"


class QuantEmbedding(nn.Module):
    """Token embedding rows read from quantized blocks, dequantized with the same arithmetic as the weights."""

    def __init__(self, rows: QuantizedRows) -> None:
        super().__init__()
        self.rows = rows
        self.num_embeddings, self.embedding_dim = rows.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).cpu().numpy()
        return torch.from_numpy(self.rows.take(flat).dequantize()).view(*ids.shape, self.embedding_dim)
