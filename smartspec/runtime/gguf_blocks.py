"""GGUF block formats unpacked into integer codes and group scales, without dequantizing.

Every format the engine keeps quantized reads, per group of `group` weights of one output row,

    w = s * q (+ o)      s = d[superblock] (* sc[group]),   o = off[superblock] (* mn[group])

computed in that order in fp32 (one rounding per operation): exactly the floats GGUF readers (gguf-py, and so
transformers) produce when they dequantize. The CPU kernel (engine/kernels/quant_linear.cpp) computes linears
from this form. The byte layouts are ggml's; `gguf.quants.dequantize` is the reference the tests compare with."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QK_K = 256  # weights per K-quant superblock


@dataclass
class QuantizedRows:
    """A weight [N, K] as integer codes and group scales; see the module docstring for the formula."""
    kind: str  # the GGUF type name: Q4_K, Q6_K, Q8_0, Q5_0, Q4_1
    q: np.ndarray  # int8 [N, K]
    d: np.ndarray  # float32 [N, K / superblock]
    sc: np.ndarray | None  # int8 [N, K / group]
    off: np.ndarray | None  # float32 [N, K / superblock]
    mn: np.ndarray | None  # int8 [N, K / group]
    group: int
    superblock: int
    nibble: bool  # q fits in 4 bits (0..15): stored two to a byte

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape

    def take(self, rows: np.ndarray) -> QuantizedRows:
        """These rows only (or these rows in this order)."""
        def pick(a):
            return None if a is None else a[rows]
        return QuantizedRows(self.kind, self.q[rows], self.d[rows], pick(self.sc), pick(self.off), pick(self.mn),
                             self.group, self.superblock, self.nibble)

    def columns(self, cols: slice) -> QuantizedRows:
        """The weights of input columns [start, stop) of every row: whole superblocks only."""
        start, stop, sb = cols.start, cols.stop, self.superblock
        if start % sb or stop % sb:
            raise ValueError(f"columns {start}:{stop} of {self.kind} are not whole {sb}-weight superblocks")

        def part(a, per):
            return None if a is None else np.ascontiguousarray(a[:, start // per:stop // per])
        return QuantizedRows(self.kind, part(self.q, 1), part(self.d, sb), part(self.sc, self.group),
                             part(self.off, sb), part(self.mn, self.group), self.group, sb, self.nibble)

    def dequantize(self) -> np.ndarray:
        """The fp32 weight, by the formula above (the tests hold it to gguf-py's bits)."""
        n, k = self.q.shape
        s = np.repeat(self.d, self.superblock // self.group, axis=1)
        if self.sc is not None:
            s = s * self.sc.astype(np.float32)
        w = np.repeat(s, self.group, axis=1) * self.q.astype(np.float32)
        if self.off is not None:
            o = np.repeat(self.off, self.superblock // self.group, axis=1)
            if self.mn is not None:
                o = o * self.mn.astype(np.float32)
            w = w + np.repeat(o, self.group, axis=1)
        return w.reshape(n, k)


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[:, at:at + 2].copy().view(np.float16).astype(np.float32)[:, 0]


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """[blocks, 16] bytes -> [blocks, 32] codes: the low nibbles are values 0..15, the high ones 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _q8_0(blocks):
    return blocks[:, 2:34].copy().view(np.int8), _f16(blocks, 0), None, None, None


def _q5_0(blocks):
    low = _nibbles_32(blocks[:, 6:22])
    bits = blocks[:, 2:6].copy().view("<u4")[:, 0]
    high = ((bits[:, None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    return (low | (high << 4)).astype(np.int8) - np.int8(16), _f16(blocks, 0), None, None, None


def _q4_1(blocks):
    return _nibbles_32(blocks[:, 4:20]).astype(np.int8), _f16(blocks, 0), None, _f16(blocks, 2), None


def _q4_k(blocks):
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    s = blocks[:, 4:16]
    lo, hi, mix = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], axis=1)
    mn = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], axis=1)
    qs = blocks[:, 16:144].reshape(-1, 4, 32)  # chunk c: sub-block 2c in the low nibbles, 2c + 1 in the high
    q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, QK_K)
    # o = (-dmin) * m is -(dmin * m) bit for bit, so w = s * q + o is gguf-py's d * q - dm
    return q.astype(np.int8), d, sc.astype(np.int8), -dmin, mn.astype(np.int8)


def _q6_k(blocks):
    ql, qh = blocks[:, 0:128], blocks[:, 128:192]
    sc, d = blocks[:, 192:208].copy().view(np.int8), _f16(blocks, 208)
    # each half of 128 values: ql's low nibbles then its high nibbles (64 each); qh's 2-bit fields at shifts 0..6
    low = np.stack([ql.reshape(-1, 2, 64) & 0x0F, ql.reshape(-1, 2, 64) >> 4], axis=2).reshape(-1, QK_K)
    high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 0x03
    q = (low | (high.reshape(-1, QK_K) << 4)).astype(np.int8) - np.int8(32)
    return q, d, sc, None, None


# kind -> (block bytes, weights per block, group, unpack)
FORMATS = {
    "Q8_0": (34, 32, 32, _q8_0),
    "Q5_0": (22, 32, 32, _q5_0),
    "Q4_1": (20, 32, 32, _q4_1),
    "Q4_K": (144, QK_K, 32, _q4_k),
    "Q6_K": (210, QK_K, 16, _q6_k),
}
NIBBLE_KINDS = {"Q4_K", "Q4_1"}


def unpack(kind: str, raw: np.ndarray, n: int, k: int) -> QuantizedRows:
    """raw: the tensor's bytes as GGUF stores them (rows of k weights, n rows)."""
    if kind not in FORMATS:
        raise ValueError(f"GGUF type {kind} is not kept quantized (known: {', '.join(FORMATS)})")
    size, per_block, group, parse = FORMATS[kind]
    if k % per_block:
        raise ValueError(f"{kind} rows hold multiples of {per_block} weights, got {k}")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n * (k // per_block), size)
    q, d, sc, off, mn = parse(blocks)

    def rows(a):
        return None if a is None else np.ascontiguousarray(a).reshape(n, -1)

    return QuantizedRows(kind, rows(q), rows(d).astype(np.float32), rows(sc), rows(off), rows(mn), group, per_block,
                         kind in NIBBLE_KINDS)


class PackedRows:
    """A weight [N, K] kept as the GGUF file stores it, rows of blocks (about half the unpacked form's memory for
    4-bit formats, 94% for Q8_0): for a token embedding, where a step reads a few rows; take() unpacks those."""

    def __init__(self, kind: str, raw: np.ndarray, n: int, k: int) -> None:
        self.kind, self.raw, self.shape = kind, raw.reshape(n, -1), (n, k)  # take() checks the kind, via unpack()

    def take(self, rows: np.ndarray) -> QuantizedRows:
        """These rows, unpacked (in this order)."""
        rows = np.asarray(rows)
        return unpack(self.kind, self.raw[rows], len(rows), self.shape[1])

    def unpacked(self) -> QuantizedRows:
        return self.take(np.arange(self.shape[0]))
