"""Flat byte views of caller memory (bytes-like objects, numpy arrays, torch CPU
tensors) that share its memory: what every transfer reads from or writes into."""

from __future__ import annotations

from kvpool.errors import InvalidParams


_TENSOR_TYPES: dict[type, bool] = {}  # type -> whether its objects are torch tensors


def is_torch_tensor(obj) -> bool:
    """Whether ``obj`` is a torch tensor (checked without importing torch; the answer
    is kept per type: a batch asks once per value)."""
    kind = type(obj)
    found = _TENSOR_TYPES.get(kind)
    if found is None:
        found = _TENSOR_TYPES[kind] = kind.__module__.startswith("torch") and hasattr(kind, "data_ptr")
    return found


def tensor_byte_view(tensor) -> memoryview:
    """Flat uint8 view of a contiguous CPU tensor's storage (any dtype, bf16 included);
    the view keeps the storage alive. Raises InvalidParams (non-contiguous, CUDA)."""
    import torch

    if tensor.device.type != "cpu":
        raise InvalidParams(f"a {tensor.device.type} tensor has no host memory: register_buffer it first")
    if not tensor.is_contiguous():
        raise InvalidParams("tensor must be contiguous")
    flat = tensor.detach().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def as_byte_view(buf, writable: bool = False) -> memoryview:
    """A flat unsigned-byte memoryview of ``buf`` (bytes, bytearray, memoryview, numpy
    array, torch CPU tensor or any C-contiguous buffer), sharing its memory. Raises
    InvalidParams if not contiguous (or not writable when ``writable``)."""
    if is_torch_tensor(buf):
        return tensor_byte_view(buf)
    try:
        view = memoryview(buf)
    except TypeError:
        raise InvalidParams(f"{type(buf).__name__} does not expose a buffer") from None
    if not view.c_contiguous:
        raise InvalidParams("buffer must be C-contiguous")
    if writable and view.readonly:
        raise InvalidParams("destination buffer is read-only")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view
