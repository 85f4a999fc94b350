"""The save's host copy of the state: :class:`SnapshotBuffers`, reused from one save to the next,
and :func:`save_without_crc32`, the serialization of that copy."""

from __future__ import annotations

import threading
from typing import Any


class SnapshotBuffers:
    """Host copies of nested state, into buffers kept from one save to the next: the first snapshot allocates
    (pinned memory for a CUDA source), later ones of the same structure copy into the same buffers, so no page is
    faulted in again. Hence take a new snapshot only after the previous save finished."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], Any] = {}

    def copy(self, obj: Any) -> Any:
        """:return: ``obj`` with every tensor copied to host memory, containers rebuilt (CUDA copies awaited)."""
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
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
            self._buffers[key] = buffer
        buffer.copy_(tensor, non_blocking=tensor.is_cuda)
        if tensor.is_cuda:
            devices.add(tensor.device)
        return buffer

    def adopt(self, loaded: Any, live: Any) -> int:
        """Keep a restore's host tensors (the states' values, as a snapshot would hold them) as the next snapshot's
        buffers for their place in ``live``: the restore frees no pages (a large part of its cost) and the first save
        after it faults in none. Adopted only where both are CPU strided tensors of one shape and dtype (a CUDA
        source wants pinned buffers) and no live tensor or other adopted one shares the loaded one's storage (an
        optimizer keeps its loaded moments: a snapshot into them would write the live state).

        :param loaded: the restored state of the states to adopt for, nested like ``live``.
        :param live: the current state dicts of every state, nested (tensors, dicts, lists, tuples).
        :return: bytes adopted."""
        import torch

        pairs: list[tuple[tuple[Any, ...], Any, Any]] = []
        _pair_tensors(loaded, live, (), pairs, torch)
        shared, adopted = _storage_pointers(live, torch), 0
        for key, tensor, target in pairs:
            pointer = tensor.untyped_storage().data_ptr()
            if pointer in shared or not _same_layout(tensor, target, torch):
                continue
            shared.add(pointer)
            self._buffers[key] = tensor
            adopted += tensor.numel() * tensor.element_size()
        return adopted

    @property
    def nbytes(self) -> int:
        """Bytes held in reusable buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


def _pair_tensors(loaded: Any, live: Any, key: tuple[Any, ...], out: list, torch: Any) -> None:
    """Append ``(key, loaded tensor, live tensor)`` for every place both hold a tensor."""
    if isinstance(live, torch.Tensor):
        if isinstance(loaded, torch.Tensor):
            out.append((key, loaded, live))
    elif isinstance(live, dict) and isinstance(loaded, dict):
        for name in (name for name in live if name in loaded):
            _pair_tensors(loaded[name], live[name], key + (name,), out, torch)
    elif isinstance(live, (list, tuple)) and isinstance(loaded, (list, tuple)):
        for index, (mine, theirs) in enumerate(zip(loaded, live)):
            _pair_tensors(mine, theirs, key + (index,), out, torch)


def _storage_pointers(obj: Any, torch: Any) -> set[int]:
    """:return: the storage address of every tensor nested in ``obj``."""
    if isinstance(obj, torch.Tensor):
        return {obj.untyped_storage().data_ptr()}
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    return set().union(*(_storage_pointers(value, torch) for value in values))


def _same_layout(tensor: Any, target: Any, torch: Any) -> bool:
    """Whether ``tensor`` can be ``target``'s snapshot buffer: both CPU strided, unquantized, one shape and dtype."""
    return all(t.layout is torch.strided and not t.is_quantized and t.device.type == "cpu"
               for t in (tensor, target)) and tensor.shape == target.shape and tensor.dtype == target.dtype


_CRC_LOCK = threading.Lock()


def save_without_crc32(state: Any, writer: Any) -> None:
    """``torch.save(state, writer)`` without the zip records' CRC-32 (a second pass over the bytes, which the
    commit record's sha256 already covers). torch keeps that option process-wide: it is off only for this call,
    under a lock that serializes the manager's own saves; torch versions without the option save with CRC-32."""
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
