"""A step's host inputs sent to the device in one copy: every integer array the step's forward reads (token ids,
positions, cache slots, block tables, the attention's query groups) packed into one pinned int64 buffer, copied
without blocking the host, and split into views of their own shapes and dtypes on the device. A copy per array
costs a launch and, from pageable memory, a wait for the device each; at 64 rows a step made about twenty.

This is the one place a step's host values cross to the device (tests/test_model_runner.py counts the forward's,
tests/test_accept.py the accept stage's)."""
from __future__ import annotations

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


def upload_lists(arrays: list[list[int] | torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Lists of integers (as int64) and host integer tensors on `device`, in one copy (upload): a stage's host
    inputs, lists made tensors here, so that this module is where every host value a step sends crosses
    (tests/test_accept.py counts it)."""
    return upload([a if isinstance(a, torch.Tensor) else torch.tensor(a, dtype=torch.int64) for a in arrays], device)


def upload_values(ints: list[list[int] | torch.Tensor], floats: list[list[float]], device: torch.device) \
        -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """upload_lists, and lists of numbers as float32, all in one copy: the floats travel as their bits."""
    bits = [torch.tensor(values, dtype=torch.float32).view(torch.int32) for values in floats]
    sent = upload_lists([*ints, *bits], device)
    return sent[:len(ints)], [b.view(torch.float32) for b in sent[len(ints):]]
