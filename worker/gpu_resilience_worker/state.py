"""The ``train_state`` checkpoint item: step, running metrics, history and RNG states."""

from __future__ import annotations

import ctypes
import hashlib
import random
import time
from typing import Any, Callable

import torch

from gpu_resilience_worker.errors import ConfigError


def capture_rng() -> dict[str, Any]:
    """:return: python ``random``, torch CPU and CUDA RNG states as lists and tensors."""
    version, internal, gauss_next = random.getstate()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return {"python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
            "torch": torch.get_rng_state(), "cuda": list(cuda)}


def restore_rng(state: dict[str, Any]) -> None:
    """Restore the RNG states captured by :func:`capture_rng`."""
    python = state["python"]
    random.setstate((python["version"], tuple(python["internal"]), python["gauss_next"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _feed(digest: Any, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        tensor = obj.detach().to("cpu").contiguous().clone()
        digest.update(f"T{tensor.dtype}{list(tensor.shape)}".encode())
        digest.update(ctypes.string_at(tensor.data_ptr(), tensor.numel() * tensor.element_size()))
    elif isinstance(obj, dict):
        digest.update(b"{")
        for key in sorted(obj, key=str):
            digest.update(repr(key).encode())
            _feed(digest, obj[key])
        digest.update(b"}")
    elif isinstance(obj, (list, tuple)):
        digest.update(b"[")
        for item in obj:
            _feed(digest, item)
        digest.update(b"]")
    else:
        digest.update(repr(obj).encode())


def state_digest(state: Any) -> str:
    """:return: a sha256 over nested dicts/lists of tensors and primitives, keys sorted."""
    digest = hashlib.sha256()
    _feed(digest, state)
    return digest.hexdigest()


def settle_vector_math() -> None:
    """Let oneMKL's vector math (torch's CPU ``tanh``, ``erf``...) detect the CPU on this thread before any step,
    for every way in: in a parallel first call its lazy detection (``mkl_vml_serv_cpu_detect``) races, and a
    thread may run another code path (other low bits) than the run resumed from did."""
    torch.tanh(torch.zeros(1))  # one element: on this thread; a value training never uses


def match_threads(saved: int | None, pinned: int | None, step: int, logger: Any) -> None:
    """Train on with the torch intra-op thread count a checkpoint was written with.

    On CPU, torch's matrix products split their work by the intra-op thread count, and outside oneMKL's strict
    reproducibility mode (``MKL_CBWR=AUTO,STRICT``) the split changes the order of the floating-point sums. The
    default count comes from the machine and ``OMP_NUM_THREADS``/``MKL_NUM_THREADS``, which a retry may not share;
    so a resumed attempt uses the recorded count, unless the caller pinned one (kept, with a warning).

    :param saved: the count in the loaded ``train_state`` (``None``: not recorded).
    :param pinned: the count the caller pinned (``--threads``), or ``None``.
    :param step: the resumed step, for the log.
    :param logger: a :class:`~gpu_resilience_worker.logs.StructuredLogger`."""
    current = torch.get_num_threads()
    if saved is None or saved == current:
        return
    if pinned is None:
        torch.set_num_threads(saved)
        logger.info(f"using {saved} intra-op threads, as the checkpoint of step {step} was written with",
                    threads=saved, default_threads=current)
    else:
        logger.warning(f"--threads {current} differs from the {saved} threads the checkpoint of step {step} "
                       "was written with: the result may not be bit-identical to an uninterrupted run",
                       threads=current, checkpoint_threads=saved)


class TrainState:
    """Step counter, running metrics, per-attempt history and RNG states.

    :param fingerprint: the settings a resumable checkpoint must match.
    :param clock: monotonic clock in seconds, for the accumulated wall time."""

    def __init__(self, fingerprint: dict[str, Any], clock: Callable[[], float] = time.monotonic) -> None:
        self.fingerprint = dict(fingerprint)
        self._clock, self._attempt_started, self._elapsed_before = clock, clock(), 0.0
        self.step, self.checkpoints = 0, 0
        self.last_loss: float | None = None
        self.loss_ema: float | None = None
        self.history: list[dict[str, Any]] = []
        #: torch intra-op threads recorded in the loaded checkpoint (``None``: none loaded, or none recorded).
        self.saved_threads: int | None = None

    def observe(self, loss: float, decay: float = 0.95) -> None:
        """Record one step's loss in the running metrics."""
        self.last_loss = loss
        self.loss_ema = loss if self.loss_ema is None else decay * self.loss_ema + (1 - decay) * loss

    @property
    def elapsed_seconds(self) -> float:
        """Wall seconds of all attempts along this checkpoint lineage."""
        return self._elapsed_before + self._clock() - self._attempt_started

    def state_dict(self) -> dict[str, Any]:
        """
        :return: the state, capturing the RNG states and the torch intra-op thread count (``threads``) now."""
        return {"step": self.step, "last_loss": self.last_loss, "loss_ema": self.loss_ema,
                "checkpoints": self.checkpoints, "elapsed_seconds": self.elapsed_seconds,
                "history": [dict(entry) for entry in self.history], "fingerprint": dict(self.fingerprint),
                "rng": capture_rng(), "threads": torch.get_num_threads()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the state and RNG states.

        :raises ConfigError: when the checkpoint was written with different settings."""
        saved = state["fingerprint"]
        differing = sorted(k for k in set(saved) | set(self.fingerprint) if saved.get(k) != self.fingerprint.get(k))
        if differing:
            details = {k: [saved.get(k), self.fingerprint.get(k)] for k in differing}
            raise ConfigError(f"checkpoint was written with other settings [saved, now]: {details}")
        self.step = int(state["step"])
        self.last_loss, self.loss_ema = state["last_loss"], state["loss_ema"]
        self.checkpoints = int(state["checkpoints"])
        self._elapsed_before, self._attempt_started = float(state["elapsed_seconds"]), self._clock()
        self.history = [dict(entry) for entry in state["history"]]
        threads = state.get("threads")
        self.saved_threads = threads if isinstance(threads, int) and threads >= 1 else None
        restore_rng(state["rng"])
