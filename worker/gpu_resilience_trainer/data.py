"""Input data: the digits ``.npz`` file and a resumable, deterministic batch order."""

from __future__ import annotations

import dataclasses
import errno
import zipfile
from typing import Any

import torch

from gpu_resilience_worker.errors import DataError

REQUIRED_ARRAYS = ("x_train", "y_train", "x_test", "y_test")
#: ``OSError`` numbers that mean the input is absent or not a readable file: exit 65. Any other
#: ``OSError`` (EIO, ESTALE, ENOTCONN, a timeout of the mount) is transient: exit 1, retried.
MISSING_INPUT_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EACCES, errno.EPERM})


@dataclasses.dataclass(frozen=True)
class Dataset:
    """Standardized train and test tensors.

    :param x_train: float32 features, shape [N, F].
    :param y_train: int64 labels in [0, num_classes), shape [N].
    :param x_test: float32 features, shape [M, F].
    :param y_test: int64 labels, shape [M].
    """

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor

    @property
    def num_features(self) -> int:
        """Number of input features per sample."""
        return int(self.x_train.shape[1])

    @property
    def num_classes(self) -> int:
        """Number of classes (largest label + 1)."""
        return int(max(self.y_train.max().item(), self.y_test.max().item())) + 1


def _read_arrays(path: str) -> dict[str, Any]:
    import numpy  # only to read the .npz container

    try:
        with numpy.load(path, allow_pickle=False) as archive:
            missing = [name for name in REQUIRED_ARRAYS if name not in archive.files]
            if missing:
                raise DataError(f"{path}: missing arrays {missing}")
            return {name: archive[name] for name in REQUIRED_ARRAYS}
    except DataError:
        raise
    except OSError as exc:
        if exc.errno in MISSING_INPUT_ERRNOS:
            raise DataError(f"{path}: cannot open the .npz file: {exc.strerror or exc}") from None
        raise  # transient (I/O error of the mount): retryable
    except (ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise DataError(f"{path}: cannot read the .npz file: {exc}") from None


def _check_split(x: torch.Tensor, y: torch.Tensor, split: str) -> None:
    if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] == 0:
        raise DataError(f"x_{split} must have shape [N>0, F>0], got {list(x.shape)}")
    if y.ndim != 1 or y.shape[0] != x.shape[0]:
        raise DataError(f"y_{split} must have shape [{x.shape[0]}], got {list(y.shape)}")
    if not torch.isfinite(x).all():
        raise DataError(f"x_{split} contains NaN or infinite values")
    if (y < 0).any():
        raise DataError(f"y_{split} contains negative labels")


def load_dataset(path: str) -> Dataset:
    """Read, validate and standardize the data (per-feature mean/std of the training split).

    :param path: the ``.npz`` file with ``x_train`` [N,F], ``y_train`` [N], ``x_test``, ``y_test``.
    :raises DataError: when the file is missing, not an ``.npz`` or the arrays are invalid.
    :raises OSError: on a transient read error (e.g. EIO of a mount), which is retryable.
    """
    arrays = _read_arrays(path)
    try:
        x_train, x_test = (torch.as_tensor(arrays[k]).to(torch.float32) for k in ("x_train", "x_test"))
        y_train, y_test = (torch.as_tensor(arrays[k]) for k in ("y_train", "y_test"))
    except (TypeError, RuntimeError) as exc:
        raise DataError(f"{path}: arrays are not numeric: {exc}") from None
    if y_train.is_floating_point() or y_test.is_floating_point() or y_train.dtype == torch.bool:
        raise DataError(f"{path}: labels must be integers")
    y_train, y_test = y_train.to(torch.int64), y_test.to(torch.int64)
    _check_split(x_train, y_train, "train")
    _check_split(x_test, y_test, "test")
    if x_test.shape[1] != x_train.shape[1]:
        raise DataError(f"x_test has {x_test.shape[1]} features, x_train {x_train.shape[1]}")
    mean = x_train.mean(dim=0)
    std = x_train.std(dim=0, unbiased=False).clamp_min(1e-6)
    std = torch.where(std < 1e-3, torch.ones_like(std), std)
    return Dataset((x_train - mean) / std, y_train, (x_test - mean) / std, y_test)


def epoch_permutation(seed: int, epoch: int, size: int) -> torch.Tensor:
    """:return: the sample order of one epoch, a function of ``(seed, epoch)`` only."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(size, generator=generator)


class EpochSampler:
    """Yields index batches in a per-epoch permutation; its position is checkpointed.

    The last batch of an epoch may be smaller. State: ``{epoch, position}``.

    :param size: number of training samples.
    :param batch_size: samples per batch.
    :param seed: seed of the epoch permutations.
    """

    def __init__(self, size: int, batch_size: int, seed: int) -> None:
        self.size, self.batch_size, self.seed = size, batch_size, seed
        self.epoch = 0
        self.position = 0
        self._order: torch.Tensor | None = None

    def next_indices(self) -> torch.Tensor:
        """:return: the indices of the next batch, advancing the position."""
        if self.position >= self.size:
            self.epoch, self.position, self._order = self.epoch + 1, 0, None
        if self._order is None:
            self._order = epoch_permutation(self.seed, self.epoch, self.size)
        batch = self._order[self.position : self.position + self.batch_size]
        self.position += int(batch.shape[0])
        return batch

    def state_dict(self) -> dict[str, Any]:
        """:return: ``{epoch, position, size, batch_size, seed}``."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "size": self.size,
            "batch_size": self.batch_size,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the position; the permutation is recomputed from the seed and epoch."""
        self.epoch, self.position, self._order = int(state["epoch"]), int(state["position"]), None
