"""Zero-copy restore into CPU modules: parameters and buffers take over the loaded tensors' memory.

A restore reads the checkpoint once into a private in-memory copy and deserializes it with
``torch.load(mmap=True)``: each loaded tensor is then a view of that copy. ``Module.load_state_dict``
would copy every tensor once more into the module's own memory, which for a multi-GB state on a
CPU costs about as long as the read itself. :func:`adopt_loaded_tensors` first points each
eligible parameter and buffer at the loaded tensor (``param.data = loaded``: the same
``Parameter`` object, so an optimizer built on it keeps working), after which the module's own
``load_state_dict`` finds source and destination to be the same memory and copies nothing (torch
skips a copy between two views of the same data), while its key, shape and hook handling runs
as always. The module's previous memory is freed.

Only what is safe to share is adopted: a plain CPU tensor of the same dtype, shape and strides
that owns its whole storage, into a parameter or buffer of the module that owns its whole storage
(no view into a flat buffer, no storage shared with another tensor, nothing quantized, sparse or a
tensor subclass), each loaded storage into one destination only. Everything else is copied by ``load_state_dict`` as before; CUDA
modules are always copied.
"""

from __future__ import annotations

from typing import Any, Mapping


def _owns_storage(tensor: Any) -> bool:
    return tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == tensor.nbytes


def _sole_user(tensor: Any) -> bool:
    """Whether no other tensor shares ``tensor``'s storage (another ``Parameter`` made from its
    ``.data``, a ``.data``/``detach()`` alias kept by an EMA helper, a view): such a tie holds
    only while both keep the same memory, so the tensor must be copied into, not re-pointed.
    Where torch cannot tell (no ``_storage_Use_Count``), the answer is no."""
    import torch

    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return False
    storage = tensor.untyped_storage()  # this wrapper holds one reference, the tensor the other
    return use_count(storage._cdata) <= 2


def adoptable(target: Any, source: Any) -> bool:
    """Whether ``target`` (a module's parameter or buffer) may take over ``source``'s memory.

    :param target: the tensor in the module.
    :param source: the loaded tensor for the same key.
    :return: ``True`` only for two plain, dense, strided CPU tensors of one dtype, shape and
        strides, each owning its whole storage, neither conjugated nor negated, and no other
        tensor sharing ``target``'s storage.
    """
    import torch

    if type(source) is not torch.Tensor or type(target) not in (torch.Tensor, torch.nn.Parameter):
        return False
    if source.device.type != "cpu" or target.device.type != "cpu":
        return False
    if source.layout != torch.strided or target.layout != torch.strided:
        return False
    if source.is_quantized or target.is_quantized or source.requires_grad:
        return False
    if source.is_conj() or source.is_neg() or target.is_conj() or target.is_neg():
        return False
    if (source.dtype, source.shape, source.stride()) != (target.dtype, target.shape, target.stride()):
        return False
    return _owns_storage(source) and _owns_storage(target) and _sole_user(target)


def adopt_loaded_tensors(obj: Any, state: Any) -> int:
    """Point a CPU module's parameters and buffers at the loaded tensors of ``state``.

    Call it right before ``obj.load_state_dict(state)``, with tensors that nothing else uses (a
    freshly loaded checkpoint): the module then shares their memory, and writes to the module
    write into it. Anything but an ``nn.Module`` with a mapping is left alone.

    :param obj: the object about to load ``state``.
    :param state: its loaded state dict (key to tensor, as ``obj.state_dict()`` names them).
    :return: the bytes adopted (0 when nothing was eligible).
    """
    import torch

    if not isinstance(obj, torch.nn.Module) or not isinstance(state, Mapping):
        return 0
    owned = {id(t) for t in obj.parameters()} | {id(t) for t in obj.buffers()}
    into: dict[int, int] = {}  # a loaded storage's address -> id of the tensor that took it
    adopted = 0
    with torch.no_grad():
        for key, target in obj.state_dict(keep_vars=True).items():
            source = state.get(key)
            if id(target) not in owned or not adoptable(target, source):
                continue
            address = source.untyped_storage().data_ptr()
            if into.setdefault(address, id(target)) != id(target):
                continue  # one loaded storage, two separate destinations: keep them separate
            target.data = source
            adopted += source.nbytes
    return adopted
