"""Background saves that write an optimizer's tensors from live memory instead of a host copy.

A training step changes the parameters and the optimizer state only in ``optimizer.step()``
(forward and backward read them; ``zero_grad`` and gradient clipping touch gradients, which a
checkpoint does not hold). So a background save can serialize those tensors where they are,
while the next step's forward and backward run, provided the next ``optimizer.step()`` waits
until the save has read them: the snapshot idea of CheckFreq (Mohan et al., FAST 2021), with
the wait in a step pre-hook (``Optimizer.register_step_pre_hook``, torch >= 2.0).

On CPU this saves what the host copy costs, a pass over the whole state at memory speed on the
training thread, and the memory of a second state. It costs a wait in ``step()`` when the write
takes longer than the next forward and backward: on slow storage far more than the copy. So the
manager chooses per save, by measurement: live when the last save's serialization time less the
last windows (from a save to the next ``step()``, the median of the last five) is shorter than
the copy of those tensors would take at the last copy's measured rate; a copy otherwise, and
always for the first two saves (the first copy allocates its buffers, so the second is the
first whose rate is a copy rate).

What may be written live: CPU tensors (strided, not quantized, not inference tensors, which keep
no version counter; at least :data:`LIVE_MIN_BYTES`)
whose storage is a trainable parameter of, or a state tensor held by, a ``torch.optim.Optimizer``
passed to the manager among its states, when none of those optimizers holds a tensor on another
device (a GPU state is copied into pinned host buffers, fast, and the background write never
holds up a step). Everything else is copied as before (buffers such as batch-norm statistics,
which the forward pass changes; frozen parameters, ``requires_grad=False``, even in an
optimizer; RNG states; tensors of other objects).

A tensor changed in place outside ``optimizer.step()`` while the save reads it (a
sharpness-aware minimization's first step, a manual ``param.add_()``, the forward pass of an
``nn.Embedding`` with ``max_norm``, which renormalizes its rows) would make the checkpoint a mix
of two steps. The save records each live tensor's version counter (the one autograd keeps,
bumped by every in-place operation) and checks it after the write: a changed one fails that
save before its commit record exists, and :class:`StepGuard` copies everything from then on.
The check is best-effort for changes outside ``step()``: changes through ``tensor.data`` or
raw kernels do not bump the counter, and an in-place kernel still running when the check comes
has not bumped it yet. Code that changes parameters in place outside ``step()`` saves with
``async_mode=AsyncMode.COPY`` (or ``DISABLED``). Within ``step()`` nothing is left to chance: a
step runs only after the save has read the tensors, or after a stop, which fails the save.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable, Mapping

#: Smaller tensors are always copied: the copy costs nothing, the version check is skipped.
LIVE_MIN_BYTES = 1 << 20


def live_write_pays(serialize_seconds: float | None, window_seconds: float | None, live_bytes: int,
                    copy_bytes_per_second: float | None) -> bool:
    """Whether writing ``live_bytes`` from live memory is expected to hold a training loop up for
    less than copying them first.

    A live write holds the next ``step()`` for what the serialization takes beyond the window
    before it; a copy holds the loop for the copy.

    :param serialize_seconds: the last background save's serialization time, seconds.
    :param window_seconds: the time from a save to the next ``step()``, seconds.
    :param live_bytes: the bytes that would be written live.
    :param copy_bytes_per_second: the last measured host copy rate.
    :return: ``serialize - window < live_bytes / copy rate``; ``False`` while a measure is
        missing (``None``) or there is nothing to write live.
    """
    if live_bytes <= 0 or None in (serialize_seconds, window_seconds, copy_bytes_per_second):
        return False
    assert serialize_seconds is not None and window_seconds is not None and copy_bytes_per_second
    return serialize_seconds - window_seconds < live_bytes / copy_bytes_per_second


class LiveTensorChanged(RuntimeError):
    """A tensor written from live memory changed while a background save read it."""


class StepGuard:
    """Holds the next ``optimizer.step()`` of the optimizers among ``states`` while a background
    save reads their tensors.

    :param states: the manager's states; every ``torch.optim.Optimizer`` among the values gets
        a step pre-hook (removed by :meth:`close`).
    :param should_stop: polled every 50 ms while ``step()`` waits; when it returns true or
        raises (a SIGTERM, the task deadline) the step goes on at once, so that the attempt can
        still stop within its grace period, and the save in flight fails in :meth:`check`
        whatever the step writes: no mixed checkpoint is committed. Default: never.
    :param on_wait: called with the seconds each ``step()`` waited.
    :param clock: monotonic clock in seconds.
    """

    def __init__(self, states: Mapping[str, Any], *, should_stop: Callable[[], bool] | None = None,
                 on_wait: Callable[[float], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        import torch

        self._clock = clock
        self._should_stop = should_stop or (lambda: False)
        self._on_wait = on_wait or (lambda seconds: None)
        self._optimizers = [obj for obj in states.values() if isinstance(obj, torch.optim.Optimizer)]
        self._released = threading.Event()
        self._released.set()
        self._handles = [opt.register_step_pre_hook(self._before_step) for opt in self._optimizers]
        self._versions: list[tuple[Any, int]] = []
        self._overran = False
        self._marked: float | None = None
        self._windows: deque[float] = deque(maxlen=5)
        #: Set when a live tensor changed outside ``step()``: every later save copies.
        self.copy_all = False

    @property
    def active(self) -> bool:
        """Whether a save may write tensors live: an optimizer is guarded and nothing has
        changed a live tensor outside its ``step()`` so far."""
        return bool(self._optimizers) and not self.copy_all

    def live_storages(self) -> dict[int, int]:
        """:return: storage address -> bytes of the tensors that may be written live (see the
        module docs); empty when not :attr:`active` or when an optimizer holds a tensor on
        another device than the CPU."""
        if not self.active:
            return {}
        import torch

        found: dict[int, int] = {}
        tensors = [param for optimizer in self._optimizers for group in optimizer.param_groups
                   for param in group["params"] if param.requires_grad]
        tensors += [value for optimizer in self._optimizers for per_param in optimizer.state.values()
                    if isinstance(per_param, dict) for value in per_param.values()
                    if isinstance(value, torch.Tensor)]
        for tensor in tensors:
            if tensor.device.type != "cpu":
                return {}
            if tensor.layout is torch.strided and not tensor.is_quantized and not tensor.is_inference():
                storage = tensor.untyped_storage()
                if storage.nbytes() >= LIVE_MIN_BYTES and storage.data_ptr():
                    found[storage.data_ptr()] = storage.nbytes()
        return found

    def mark(self) -> None:
        """A save returned: the next ``step()`` closes a window (see :meth:`window`)."""
        self._marked = self._clock()

    def window(self) -> float | None:
        """:return: the median of the last five windows from a save to the next ``step()``
        (seconds: what a live write overlaps), or ``None`` before one was seen."""
        if not self._windows:
            return None
        ordered = sorted(self._windows)
        return ordered[len(ordered) // 2]

    def hold(self, live: list[Any]) -> None:
        """Make the next ``step()`` wait until :meth:`release`; remember ``live``'s versions."""
        self._versions = [(tensor, tensor._version) for tensor in live]
        self._overran = False
        self._released.clear()

    def check(self) -> None:
        """Called by the saving thread once it has read every live tensor.

        :raises LiveTensorChanged: when one changed in place since :meth:`hold` (every later
            save then copies).
        """
        if self._overran:
            self.copy_all = True
            raise LiveTensorChanged(
                "a stop let optimizer.step() run while the background save read its tensors; this checkpoint "
                "is discarded (the step may write through .data or a kernel no version counter sees)"
            )
        changed = sum(1 for tensor, version in self._versions if tensor._version != version)
        if changed:
            self.copy_all = True
            raise LiveTensorChanged(
                f"{changed} tensor(s) an optimizer steps changed in place outside optimizer.step() while "
                "the background save read them; this checkpoint is discarded and later saves copy the state"
            )

    def release(self) -> None:
        """Let a waiting ``step()`` go on (always called, also when the save failed)."""
        self._versions = []
        self._released.set()

    def wait(self) -> None:
        """Block until the save in flight has read the live tensors, or a stop is requested."""
        if self._released.is_set():
            return
        started = self._clock()
        while not self._released.wait(0.05):
            try:
                stop = self._should_stop()
            except Exception:  # noqa: BLE001 - a stop check that fails counts as a stop: never hang here
                stop = True
            if stop:
                self._overran = True  # the save in flight fails in check(), however the step writes
                break
        self._on_wait(self._clock() - started)

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._marked is not None:
            self._windows.append(self._clock() - self._marked)
            self._marked = None
        self.wait()

    def close(self) -> None:
        """Remove the step pre-hooks (after the save in flight released them)."""
        self._released.set()
        for handle in self._handles:
            handle.remove()
        self._handles = []
