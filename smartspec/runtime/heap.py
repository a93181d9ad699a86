"""The Python heap a serving process keeps once it has started.

A full (oldest-generation) collection walks every tracked object, and a started process holds hundreds of thousands
(torch, the tokenizer, Ray): each such collection stalls whichever step it lands in, for longer than a step
(docs/architecture.md). What start built lives as long as the process; freezing it leaves the collector the objects
serving makes."""
from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


def freeze_startup_heap() -> None:
    """Collect what starting left behind, then move every object alive into the collector's permanent generation,
    for the rest of the process (a replica, once its engine is built). Cycles among frozen objects are never
    collected: for an engine that lives as long as its process, not for one of many built in a process."""
    gc.collect()
    gc.freeze()


@contextmanager
def frozen_heap() -> Iterator[None]:
    """freeze_startup_heap for the time of a block, what was frozen handed back to the collector after it (a
    simulated replica in a process that builds many)."""
    freeze_startup_heap()
    try:
        yield
    finally:
        gc.unfreeze()
