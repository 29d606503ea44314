"""Caller memory registered for transfers: bytes-like objects, numpy arrays, torch CPU
tensors, and torch CUDA tensors when CUDA is available.

Registration turns the object into a flat byte memoryview once (checking it is
C-contiguous, and writable if it will receive data) and keeps a reference, so later
puts read straight from it and gets write straight into it: no copy on the client side.
A CUDA tensor has no host address a socket or memcpy can use; it gets a pinned host
staging buffer of the same size: ``before_write`` copies device → staging before a put,
``after_read`` copies staging → device after a get (the one unavoidable copy).
"""

from __future__ import annotations

import itertools
import threading

from kvpool.errors import InvalidParams
from kvpool.transfer.views import as_byte_view, is_torch_tensor, tensor_byte_view


class RegisteredBuffer:
    """One registered region. ``view``: its host bytes (for a CUDA tensor, the staging
    buffer); ``nbytes``; ``id``: the number :meth:`BufferRegistry.register` returned."""

    def __init__(self, buf_id: int, obj):
        self.id = buf_id
        self.obj = obj
        self.device = None
        if is_torch_tensor(obj) and obj.device.type == "cuda":
            import torch

            if not obj.is_contiguous():
                raise InvalidParams("tensor must be contiguous")
            self.device = obj.detach().reshape(-1).view(torch.uint8)
            self._staging = torch.empty(self.device.numel(), dtype=torch.uint8, pin_memory=True)
            self.view = memoryview(self._staging.numpy())
        elif is_torch_tensor(obj):
            self.view = tensor_byte_view(obj)
        else:
            self.view = as_byte_view(obj)
        self.nbytes = len(self.view)

    def region(self, offset: int, length: int) -> memoryview:
        """``length`` bytes at ``offset``. Raises InvalidParams when out of range."""
        if offset < 0 or length < 0 or offset + length > self.nbytes:
            raise InvalidParams(f"[{offset}, +{length}) exceeds the {self.nbytes}-byte registered buffer")
        return self.view[offset : offset + length]

    def before_write(self, offset: int, length: int) -> None:
        """Make host bytes current before they are sent (CUDA: device → staging)."""
        if self.device is not None:
            self._staging[offset : offset + length].copy_(self.device[offset : offset + length])

    def after_read(self, offset: int, length: int) -> None:
        """Publish received host bytes (CUDA: staging → device, synchronised)."""
        if self.device is not None:
            self.device[offset : offset + length].copy_(self._staging[offset : offset + length])
            import torch

            torch.cuda.current_stream(self.device.device).synchronize()


class BufferRegistry:
    """Registered buffers by id; thread-safe."""

    def __init__(self):
        self._bufs: dict[int, RegisteredBuffer] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def register(self, obj) -> RegisteredBuffer:
        """Register ``obj``. Raises InvalidParams for memory that cannot be used."""
        with self._lock:
            reg = RegisteredBuffer(next(self._ids), obj)
            self._bufs[reg.id] = reg
            return reg

    def unregister(self, buf: RegisteredBuffer | int) -> bool:
        with self._lock:
            return self._bufs.pop(buf if isinstance(buf, int) else buf.id, None) is not None

    def get(self, buf_id: int) -> RegisteredBuffer:
        with self._lock:
            reg = self._bufs.get(buf_id)
        if reg is None:
            raise InvalidParams(f"no registered buffer {buf_id}")
        return reg

    def clear(self) -> None:
        with self._lock:
            self._bufs.clear()
