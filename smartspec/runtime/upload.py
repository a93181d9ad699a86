"""A step's host inputs sent to the device in one copy: every integer array the step's forward reads (token ids,
positions, cache slots, block tables, the attention's query groups) packed into one pinned int64 buffer, copied
without blocking the host, and split into views of their own shapes and dtypes on the device. A copy per array
costs a launch and, from pageable memory, a wait for the device each; at 64 rows a step made about twenty.

This is the one place a step's host values cross to the device (tests/test_model_runner.py counts the forward's,
tests/test_accept.py the accept stage's)."""
from __future__ import annotations

import itertools
from collections.abc import Collection

import torch


def upload(arrays: list[torch.Tensor | None], device: torch.device) -> list[torch.Tensor | None]:
    """The arrays (host integer tensors; None passes through) on `device`, in one non-blocking copy. On the CPU
    they are the arrays themselves: there is nothing to copy."""
    if device.type == "cpu":
        return list(arrays)
    present = [a for a in arrays if a is not None]
    sizes = [a.numel() for a in present]
    packed = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=True)
    if present:
        torch.cat([a.reshape(-1).to(torch.int64) for a in present], out=packed)
    # pinned: the copy runs on the device's stream while the host goes on (the caching host allocator keeps the
    # buffer until the copy is done)
    on_device = iter(packed.to(device, non_blocking=True).split(sizes))
    return [None if a is None else next(on_device).view(a.shape).to(a.dtype) for a in arrays]


def upload_lists(arrays: list[list[int] | list[float] | torch.Tensor], device: torch.device,
                 floats: Collection[int] = ()) -> list[torch.Tensor]:
    """Lists of integers (as int64), lists of numbers (those at the indices `floats`, as float32: they travel as
    their bits) and host integer tensors on `device`, in one copy (upload): a stage's host inputs, lists made
    tensors here, so that this module is where every host value a step sends crosses (tests/test_accept.py counts
    it)."""
    staged: list[torch.Tensor | None] = [a if isinstance(a, torch.Tensor) else None for a in arrays]
    # the lists of each kind made one host tensor, and split: a tensor a list was most of a stage's host operations
    for kind, dtype in ((False, torch.int64), (True, torch.float32)):
        keys = [i for i, a in enumerate(arrays) if staged[i] is None and (i in floats) == kind]
        if keys:
            joined = torch.tensor(list(itertools.chain.from_iterable(arrays[i] for i in keys)), dtype=dtype)
            parts = joined.view(torch.int32) if kind else joined  # numbers travel as their bits
            for i, part in zip(keys, parts.split([len(arrays[i]) for i in keys])):
                staged[i] = part
    sent = upload(staged, device)
    return [t.view(torch.float32) if i in floats else t for i, t in enumerate(sent)]


class HostBatch:
    """A stage's host values, gathered while it plans on the host and sent to the device together in one copy
    (upload_lists): each part of the stage stages its values (`ints`, `floats`) and keeps the keys they return,
    then reads its tensors from what `send` returns, by key. A stage that sends once is one whose device work waits
    for no host value made along the way (the accept stage: its controls, masks, chains and plain rows)."""

    def __init__(self) -> None:
        self._values: list[list[int] | list[float] | torch.Tensor] = []
        self._floats: set[int] = set()  # the keys of numbers sent as float32

    def ints(self, values: list[int] | torch.Tensor) -> int:
        """Integers (a list, as int64, or a host integer tensor of any shape); their key in send's answer."""
        self._values.append(values)
        return len(self._values) - 1

    def floats(self, values: list[float]) -> int:
        """Numbers, as float32; their key in send's answer."""
        key = self.ints(values)
        self._floats.add(key)
        return key

    def send(self, device: torch.device) -> list[torch.Tensor]:
        """Every staged value on `device`, in one copy (none where nothing was staged), indexed by key."""
        return upload_lists(self._values, device, self._floats) if self._values else []
