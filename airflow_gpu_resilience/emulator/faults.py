"""Fault injection: API errors and delays for ``/v2`` requests.

Maintenance preemption lives in :meth:`~.backend.CloudRunBackend.preempt` (the admin endpoint
``POST /_emulator/preempt`` calls it); this module holds the API-level faults configured by
``POST /_emulator/faults`` with a JSON body (all keys optional; ``{}`` clears every fault)::

    {"failNext": 2,          # the next N API requests fail
     "errorRate": 0.2,       # then each request fails with this probability
     "codes": [503, 429],    # HTTP codes to draw from (503 UNAVAILABLE, 429 RESOURCE_EXHAUSTED)
     "delaySeconds": 0.5,    # added latency per request
     "seed": 1}              # random seed, for reproducible runs

Faults apply to the Cloud Run API only, never to ``/_emulator`` or the GCS emulator.
"""

from __future__ import annotations

import dataclasses
import random
import threading

from .exceptions import EmulatorError, InvalidArgument, ResourceExhausted, Unavailable

_ERRORS = {503: Unavailable, 429: ResourceExhausted}


@dataclasses.dataclass
class FaultConfig:
    """One fault configuration (see the module docstring for the JSON keys)."""

    fail_next: int = 0
    error_rate: float = 0.0
    codes: tuple = (503,)
    delay_seconds: float = 0.0
    seed: int = 0

    @classmethod
    def from_json(cls, data: dict) -> "FaultConfig":
        codes = tuple(data.get("codes", (503,)))
        if not codes or any(c not in _ERRORS for c in codes):
            raise InvalidArgument(f"codes: each must be one of {sorted(_ERRORS)}.")
        rate = float(data.get("errorRate", 0.0))
        if not 0.0 <= rate <= 1.0:
            raise InvalidArgument("errorRate: must be between 0 and 1.")
        return cls(int(data.get("failNext", 0)), rate, codes, float(data.get("delaySeconds", 0.0)),
                   int(data.get("seed", 0)))


class ApiFaults:
    """Decides, per API request, whether to delay it and whether to fail it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.configure(FaultConfig())

    def configure(self, config: FaultConfig) -> None:
        with self._lock:
            self.config = config
            self._remaining = config.fail_next
            self._random = random.Random(config.seed)

    def next_fault(self) -> tuple:
        """``(delay_seconds, error or None)`` for the next request."""
        with self._lock:
            cfg = self.config
            fail = self._remaining > 0 or (cfg.error_rate > 0 and self._random.random() < cfg.error_rate)
            if self._remaining > 0:
                self._remaining -= 1
            error: EmulatorError | None = None
            if fail:
                code = self._random.choice(cfg.codes)
                error = _ERRORS[code](f"Injected fault: the service is temporarily unavailable ({code}).")
            return cfg.delay_seconds, error
