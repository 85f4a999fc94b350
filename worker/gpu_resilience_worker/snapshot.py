"""The save's host copy of the state: :class:`SnapshotBuffers`, reused from one save to the next,
and :func:`save_without_crc32`, the serialization of that copy."""

from __future__ import annotations

import threading
from typing import Any


class SnapshotBuffers:
    """Host copies of nested state, into buffers kept from one save to the next.

    The first snapshot allocates (pinned memory when the source is on CUDA); later ones with the
    same structure copy into the same buffers, so no page is faulted in again. A snapshot's
    buffers are reused by the next one: take a new one only after the previous save finished.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], Any] = {}

    def copy(self, obj: Any) -> Any:
        """:return: ``obj`` with every tensor copied to host memory, containers rebuilt.

        CUDA copies are asynchronous and awaited before returning.
        """
        import torch

        devices: set[Any] = set()
        result = self._copy(obj, (), devices, torch)
        for device in devices:
            torch.cuda.current_stream(device).synchronize()
        return result

    def _copy(self, obj: Any, key: tuple[Any, ...], devices: set[Any], torch: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj.detach(), key, devices, torch)
        if isinstance(obj, dict):
            return {k: self._copy(v, key + (k,), devices, torch) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._copy(v, key + (i,), devices, torch) for i, v in enumerate(obj))
        return obj

    def _tensor(self, tensor: Any, key: tuple[Any, ...], devices: set[Any], torch: Any) -> Any:
        if tensor.layout is not torch.strided or tensor.is_quantized:
            return tensor.to("cpu", copy=True)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            pinned = tensor.is_cuda
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pinned)
            self._buffers[key] = buffer
        buffer.copy_(tensor, non_blocking=tensor.is_cuda)
        if tensor.is_cuda:
            devices.add(tensor.device)
        return buffer

    @property
    def nbytes(self) -> int:
        """Bytes held in reusable buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


_CRC_LOCK = threading.Lock()


def save_without_crc32(state: Any, writer: Any) -> None:
    """``torch.save(state, writer)`` without the zip records' CRC-32 (the file's sha256 in the
    commit record already covers every byte; CRC-32 would cost a second pass over the bytes).

    torch keeps that option process-wide: it is switched off only for this call, under a lock
    that serializes the manager's own saves. torch versions without the option save with it.
    """
    import torch

    getter = getattr(torch.serialization, "get_crc32_options", None)
    setter = getattr(torch.serialization, "set_crc32_options", None)
    if getter is None or setter is None:
        torch.save(state, writer)
        return
    with _CRC_LOCK:
        previous = getter()
        setter(False)
        try:
            torch.save(state, writer)
        finally:
            setter(previous)
