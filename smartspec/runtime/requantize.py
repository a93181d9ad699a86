"""Re-quantizing GGUF weights to 4-bit blocks at load (quantization "gguf_q4"): for a draft model, whose precision
barely moves what the target accepts, and whose every token streams its weights once more on a CPU bound by memory
bandwidth. Each linear held wider than 4-bit blocks (Q8_0: 8.5 bits a weight, Q6_K: 6.6, Q5_0: 5.5) becomes Q4_1
(5: per 32 weights, an fp16 scale and minimum and 4-bit codes), the int8 kernel's nibble form. Q4_K (4.5) stays.
The output layer is most of the gain: the default draft's is Q8_0, 145 MB of its ~390 MB a token."""
from __future__ import annotations

import torch

from smartspec.runtime.gguf_blocks import QuantizedRows

WIDER_THAN_4_BITS = {"Q8_0", "Q6_K", "Q5_0"}


def to_q4_1(rows: QuantizedRows, chunk_rows: int = 8192) -> QuantizedRows:
    """rows as Q4_1 blocks: per group of 32, min m and step d = (max - m) / 15, both fp16 values, and codes
    round((w - m) / d) in 0..15 (at most d / 2 off each weight, from the weights the file's blocks give). In torch,
    on its threads: the default draft's linears take ~2 s on 2 cores."""
    n, k = rows.shape
    if k % 32:
        raise ValueError(f"Q4_1 rows hold multiples of 32 weights, got {k}")
    q = torch.empty((n, k), dtype=torch.int8)
    d = torch.empty((n, k // 32), dtype=torch.float32)
    m = torch.empty((n, k // 32), dtype=torch.float32)
    for r0 in range(0, n, chunk_rows):  # a chunk at a time: an output layer's fp32 would be 0.5 GB at once
        r1 = min(n, r0 + chunk_rows)
        w = _weights(rows, r0, r1).view(r1 - r0, k // 32, 32)
        low = w.amin(dim=2).half().float()
        step = ((w.amax(dim=2) - low) / 15).half().float()
        codes = torch.round((w - low[..., None]) / torch.where(step > 0, step, 1.0)[..., None])
        q[r0:r1] = codes.clamp_(0, 15).to(torch.int8).view(r1 - r0, k)
        d[r0:r1], m[r0:r1] = step, low
    return QuantizedRows("Q4_1", q.numpy(), d.numpy(), None, m.numpy(), None, 32, 32, True)


def _weights(rows: QuantizedRows, r0: int, r1: int) -> torch.Tensor:
    """Rows [r0, r1) in fp32 by gguf_blocks' formula (w = s * q (+ o), in that order)."""
    per = rows.superblock // rows.group
    s = torch.from_numpy(rows.d[r0:r1]).repeat_interleave(per, dim=1)
    if rows.sc is not None:
        s = s * torch.from_numpy(rows.sc[r0:r1]).float()
    w = torch.from_numpy(rows.q[r0:r1]).float().view(r1 - r0, -1, rows.group) * s[..., None]
    if rows.off is not None:
        o = torch.from_numpy(rows.off[r0:r1]).repeat_interleave(per, dim=1)
        if rows.mn is not None:
            o = o * torch.from_numpy(rows.mn[r0:r1]).float()
        w = w + o[..., None]
    return w.view(r1 - r0, -1)
