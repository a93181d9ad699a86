"""The shapes a runner computes steps in, as numbers a policy can price: a step of `rows` sequences whose widest
carries `width` tokens runs as (rows' bucket) x (width's bucket) cells when it fits a bucket (CUDA graphs,
runtime/cuda_graphs.py), every cell costing what a real token costs; one that fits none runs as it comes."""
from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(frozen=True)
class PaddedShapes:
    rows: tuple[int, ...]  # row buckets, ascending
    widths: tuple[int, ...]  # width buckets (query tokens a row), ascending
    max_cells: int  # rows x width of the largest bucket

    def bucket(self, rows: int, width: int) -> tuple[int, int] | None:
        """The smallest (rows, width) bucket that holds the step; None where it runs unpadded."""
        if rows > self.rows[-1] or width > self.widths[-1]:
            return None
        r, w = self.rows[bisect.bisect_left(self.rows, rows)], self.widths[bisect.bisect_left(self.widths, width)]
        return (r, w) if r * w <= self.max_cells else None

    def forward_tokens(self, rows: int, width: int, tokens: int) -> int:
        """Token positions the forward computes for a step of `tokens` real tokens: its bucket's cells, or the
        tokens themselves where no bucket holds it."""
        bucket = self.bucket(rows, width)
        return tokens if bucket is None else bucket[0] * bucket[1]
