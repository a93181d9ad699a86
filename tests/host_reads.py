"""A detector of the operations that bring a tensor's value to the host (for the one-read-a-step tests)."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode


class HostReads(TorchDispatchMode):
    """The operations that bring a value to the host, or a host value to the tensor's device: inside a CUDA graph
    capture each is an error (or a value frozen at capture). multinomial: one operation here, but it reads its
    input's checks back to the host twice a call (ATen's Distributions.cpp: `.item()` twice) before it draws."""
    SYNCS = {"item", "_local_scalar_dense", "nonzero", "is_nonzero", "equal", "masked_select", "unique_consecutive",
             "_unique2", "unique_dim", "lift_fresh", "allclose", "multinomial"}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        bool_index = name in ("index", "index_put_", "index_put") and any(
            isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in (args[1] if len(args) > 1 else ()) or ())
        if name in self.SYNCS or bool_index:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))
