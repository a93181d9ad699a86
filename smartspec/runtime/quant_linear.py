"""Linear layers that keep GGUF weights quantized and compute from them.

Two numerics, both batch-invariant (so lossless for speculative verification):
- int8 activations (engine/kernels/q8_linear.cpp, llama.cpp's scheme): each input row is quantized to int8 blocks
  and multiplied with the weight codes in exact integer arithmetic (AVX-512 VNNI); the default.
- exact (engine/kernels/quant_linear.cpp): fp32 activations, output bitwise that of the fp32 panel kernel on the
  dequantized weight."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from smartspec.runtime.gguf_blocks import PackedRows, QuantizedRows
from smartspec.runtime.page_arena import PageArena

PANEL = 16  # output rows per panel, as the kernel's fp32 weights


def _by_panel(a: np.ndarray) -> np.ndarray:
    """Rows [N, C] -> [ceil(N / 16), 16, C] (rows padded with zeros)."""
    n, c = a.shape
    padded = np.zeros((-(-n // PANEL) * PANEL, c), dtype=a.dtype)
    padded[:n] = a
    return padded.reshape(-1, PANEL, c)


def _panels(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """Rows [N, C] -> panels [ceil(N / 16), C, 16], the layout the kernel streams."""
    return torch.from_numpy(np.ascontiguousarray(_by_panel(a).transpose(0, 2, 1))).to(dtype)


def _nibble_panels(q: np.ndarray) -> torch.Tensor:
    """Codes 0..15 [N, K] -> byte panels [P, K / 2, 16] holding q[k] | q[k + 1] << 4."""
    pairs = q.astype(np.uint8).reshape(q.shape[0], -1, 2)
    return _panels(pairs[:, :, 0] | (pairs[:, :, 1] << 4), torch.uint8)


# kind -> the bias that makes its codes unsigned (the int8 kernel's weight operand), high bits beyond a nibble
Q8_CODES = {"Q4_K": (0, 0), "Q6_K": (32, 2), "Q8_0": (128, None), "Q5_0": (16, 1), "Q4_1": (0, 0)}


def q8_blob(rows: QuantizedRows | PackedRows, chunk_rows: int = 8192, arena: PageArena | None = None) -> torch.Tensor:
    """The int8 kernel's weight [P, bytes]: per panel, superblock by superblock, codes (unsigned: q + bias), high
    bits, group scales, fp16 d and offset, padded to 64 bytes (layout: engine/kernels/q8_linear.cpp). Packed
    chunk_rows rows at a time, so that an output layer's temporaries stay small; in the arena when given."""
    n = rows.shape[0]
    blob = None
    for r0 in range(0, n, chunk_rows):
        part = _q8_blob_rows(rows.take(np.arange(r0, min(n, r0 + chunk_rows))))
        if blob is None:
            blob = (arena.zeros if arena else torch.empty)((-(-n // PANEL), part.shape[1]), dtype=torch.uint8)
        blob[r0 // PANEL:r0 // PANEL + part.shape[0]] = part
    return blob


def _q8_blob_rows(rows: QuantizedRows) -> torch.Tensor:
    bias, high = Q8_CODES[rows.kind]
    u = _by_panel((rows.q.astype(np.int16) + bias).astype(np.uint8))
    p, _, k = u.shape
    supers = k // rows.superblock
    parts = []
    if high is None:  # whole bytes: [P, K/4, 16, 4]
        parts.append(u.reshape(p, PANEL, k // 4, 4).transpose(0, 2, 1, 3))
    else:
        v = (u & 0x0F).reshape(p, PANEL, k // 8, 2, 4)  # k = 8j + 4h + i
        parts.append((v[:, :, :, 0] | (v[:, :, :, 1] << 4)).transpose(0, 2, 1, 3))
    if high:
        top = (u >> 4).reshape(p, PANEL, k // 32, 8, 4)  # k = 32t + 8s + 4h + i, combo s * 2 + h
        bits = np.zeros((p, PANEL, k // 32, high, 4), dtype=np.uint8)
        for combo in range(8):
            slot = combo * high
            bits[:, :, :, slot // 8] |= top[:, :, :, combo] << (slot % 8)
        parts.append(bits.transpose(0, 2, 3, 1, 4))
    for scales in (rows.sc, rows.mn):
        if scales is not None:
            parts.append(_panels(scales, torch.int8).numpy().view(np.uint8))
    for value in (rows.d, rows.off):
        if value is not None:
            if not np.array_equal(value.astype(np.float16).astype(np.float32), value):
                raise ValueError(f"{rows.kind} scales are not fp16 values: not GGUF blocks")
            parts.append(_panels(value.astype(np.float16), torch.float16).numpy().view(np.uint8))
    blob = np.concatenate([np.ascontiguousarray(a).reshape(p, supers, -1) for a in parts], axis=2)
    blob = np.pad(blob, ((0, 0), (0, 0), (0, -blob.shape[2] % 64)))  # superblocks on whole cache lines
    return torch.from_numpy(blob.reshape(p, -1))


class Q8Linear(nn.Module):
    """A GGUF weight computed with int8 activations (the kernel's numerics: tests/q8_reference.py)."""

    def __init__(self, rows: QuantizedRows | PackedRows, ext, bias: torch.Tensor | None = None,
                 arena: PageArena | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = rows.shape
        self.kind = rows.kind
        self.register_buffer("blob", q8_blob(rows, arena=arena))
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self._ext = ext

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._ext.q8_linear(x.reshape(-1, self.in_features), self.kind, self.blob, self.out_features, self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{self.kind} (int8 activations), in_features={self.in_features}, out_features={self.out_features}"


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

    def __init__(self, rows: QuantizedRows | PackedRows) -> None:
        super().__init__()
        self.rows = rows
        self.num_embeddings, self.embedding_dim = rows.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).cpu().numpy()
        return torch.from_numpy(self.rows.take(flat).dequantize()).view(*ids.shape, self.embedding_dim)
