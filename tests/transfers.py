"""A count of the engine's host -> device transfers (the one-copy-a-stage tests)."""
import os
import sys

import torch


class Transfers:
    """Counts, while active, every way the engine's code can send a tensor to a device: runtime/upload.py's upload
    (the runner's, and every stage's through upload_lists), `Tensor.to`, `.cuda` and `torch.tensor` naming a device,
    and `Tensor.copy_` (a padded step's staging copy).
    Nothing is exempt; only calls from the model's own code (transformers' same-device `.to`) are not the engine's."""

    def __init__(self, monkeypatch):
        from smartspec.runtime import backends
        from smartspec.runtime import upload as upload_module
        self.seen: list[str] = []
        upload, to, copy, tensor = backends.upload, torch.Tensor.to, torch.Tensor.copy_, torch.tensor

        def note(what):
            if f"{os.sep}smartspec{os.sep}" in sys._getframe(2).f_code.co_filename:
                self.seen.append(what)

        def named_device(args, kwargs):
            return "device" in kwargs or any(isinstance(a, (torch.device, str)) for a in args)

        def counted_upload(arrays, device):
            note("upload")
            return upload(arrays, device)

        def counted_to(t, *args, **kwargs):
            if named_device(args, kwargs):
                note("Tensor.to")
            return to(t, *args, **kwargs)

        def counted_copy(t, src, *args, **kwargs):
            note("Tensor.copy_")
            return copy(t, src, *args, **kwargs)

        def counted_tensor(*args, **kwargs):
            if "device" in kwargs:
                note("torch.tensor(device=)")
            return tensor(*args, **kwargs)

        def counted_cuda(t, *args, **kwargs):
            note("Tensor.cuda")
            return t

        monkeypatch.setattr(backends, "upload", counted_upload)
        monkeypatch.setattr(upload_module, "upload", counted_upload)
        monkeypatch.setattr(torch.Tensor, "to", counted_to)
        monkeypatch.setattr(torch.Tensor, "copy_", counted_copy)
        monkeypatch.setattr(torch.Tensor, "cuda", counted_cuda)
        monkeypatch.setattr(torch, "tensor", counted_tensor)
