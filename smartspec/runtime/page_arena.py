"""Tensors that live in 2 MiB pages.

A decode step streams every weight once; on 4 KiB pages that is a TLB miss every 4 KiB (costlier still under a
hypervisor's nested paging); in 2 MiB pages a decode step is faster (docs/architecture.md gives the figure).
Linux gives anonymous memory huge pages only where asked (`madvise` mode, the usual
default), so the weights are packed into one mapping that asks before any page is touched. Where huge pages are
off or unknown (another OS), or with SMARTSPEC_HUGE_PAGES=0, the mapping is ordinary memory and nothing else
changes. `release_freed_memory` hands what malloc holds on freed chunks back to the OS (loading calls it)."""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import mmap
import os
import sys

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
ALIGN = 64  # a cache line: the kernels' superblocks start on one
# Linux: reserve address space, not memory (the unused tail is never touched); elsewhere the flag's value differs
_MAP_NORESERVE = 0x4000 if sys.platform.startswith("linux") else 0


class PageArena:
    """A bump allocator over one anonymous mapping of `capacity` bytes. The kernel hands out zeroed pages as they
    are first written, so a generous capacity costs address space only, and a KV cache costs memory as it fills.
    Tensors from it keep the mapping alive; when it is full, zeros() falls back to torch.zeros."""

    def __init__(self, capacity: int, huge_pages: bool | None = None) -> None:
        """huge_pages None: unless SMARTSPEC_HUGE_PAGES=0; False asks for ordinary pages (for comparisons)."""
        self._map = mmap.mmap(-1, capacity + HUGE_PAGE,
                              flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
        wanted = os.environ.get("SMARTSPEC_HUGE_PAGES") != "0" if huge_pages is None else huge_pages
        self.huge_pages = wanted and hasattr(mmap, "MADV_HUGEPAGE")
        advice = getattr(mmap, "MADV_HUGEPAGE" if self.huge_pages else "MADV_NOHUGEPAGE", None)
        if advice is not None:
            try:
                self._map.madvise(advice)
            except OSError as exc:  # a kernel built without transparent huge pages
                logger.info("4 KiB pages (madvise: %s)", exc)
                self.huge_pages = False
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self._start = self._next = (-self._bytes.data_ptr()) % HUGE_PAGE  # from a huge-page boundary
        self._end = self._start + capacity
        self.overflowed = 0

    @property
    def used(self) -> int:
        return self._next - self._start

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zero tensor (the mapping's bytes are handed out once, never reused)."""
        nbytes = math.prod(shape) * dtype.itemsize
        start = -(-self._next // ALIGN) * ALIGN
        if start + nbytes > self._end:
            self.overflowed += nbytes
            return torch.zeros(shape, dtype=dtype)
        self._next = start + nbytes
        return self._bytes[start:start + nbytes].view(dtype).view(shape)


@functools.cache
def _malloc_trim():
    libc = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(libc).malloc_trim if libc else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to call
        return None


def release_freed_memory() -> None:
    """Give the memory malloc holds on freed chunks back to the OS (glibc's malloc_trim; elsewhere nothing).

    Loading a model frees many large temporaries. On the main thread glibc returns them; on any other thread (a
    Serve replica builds its engine off the main thread) they land in per-thread heaps of at most 64 MiB that are
    only given back from their top, and loading the 1.5B left 0.4 GiB of freed chunks resident."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
