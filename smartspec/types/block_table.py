"""A request's KV cache blocks, in order, kept in a growable int32 array: the step's inputs copy each request's
table as an array (runtime/model_runner.prepare_step), where from a Python list every step converted it element
by element, a cost that grew with the request's context. Blocks are only appended and popped at the end (or all
cleared), as a list's would be; reading it as a list still works."""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np


class BlockTable:
    """A list of block ids backed by an int32 array (`array()`: the blocks held, read-only)."""
    __slots__ = ("_blocks", "_size")

    def __init__(self, blocks: Iterable[int] = ()) -> None:
        held = np.fromiter(blocks, np.int32)
        self._blocks = np.zeros(max(8, len(held)), np.int32)
        self._blocks[:len(held)] = held
        self._size = len(held)

    def array(self) -> np.ndarray:
        """The blocks held, as a view of the array (valid until the table next changes)."""
        return self._blocks[:self._size]

    def append(self, block: int) -> None:
        if self._size == len(self._blocks):
            self._blocks = np.concatenate([self._blocks, np.zeros(len(self._blocks), np.int32)])
        self._blocks[self._size] = block
        self._size += 1

    def pop(self) -> int:
        if not self._size:
            raise IndexError("pop from an empty block table")
        self._size -= 1
        return int(self._blocks[self._size])

    def clear(self) -> None:
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.array()[index].tolist()
        if not -self._size <= index < self._size:
            raise IndexError("block table index out of range")
        return int(self._blocks[index % self._size])

    def __iter__(self) -> Iterator[int]:
        return iter(self.array().tolist())

    def __reversed__(self) -> Iterator[int]:
        return reversed(self.array().tolist())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (BlockTable, list, tuple)):
            return len(self) == len(other) and self.array().tolist() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable, equal to lists

    def __repr__(self) -> str:
        return f"BlockTable({self.array().tolist()})"

    def __reduce__(self):
        return BlockTable, (self.array().tolist(),)
