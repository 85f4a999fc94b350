"""Fault injection: API errors and delays for ``/v2`` requests, and seeded preemption schedules.

A single maintenance preemption lives in :meth:`~.backend.CloudRunBackend.preempt` (the admin
endpoint ``POST /_emulator/preempt`` calls it). This module holds the API-level faults
configured by ``POST /_emulator/faults`` with a JSON body (all keys optional; ``{}`` clears
every fault)::

    {"failNext": 2,          # the next N API requests fail (REST or gRPC)
     "errorRate": 0.2,       # then each request fails with this probability
     "codes": [503, 429],    # HTTP codes to draw from (503 UNAVAILABLE, 429 RESOURCE_EXHAUSTED;
                             #   over gRPC their codes, 14 and 8)
     "delaySeconds": 0.5,    # added latency per request
     "seed": 1,              # random seed, for reproducible runs
     "loseAnswerNext": 1,    # the next N mutating requests (REST: POST/PATCH/DELETE) are applied, then
     "loseAnswerCode": 500}  #   answered with this error (500 INTERNAL or 504 DEADLINE_EXCEEDED;
                             #   over gRPC its code, 13 or 4)

``loseAnswerNext`` is the case a client cannot tell from a rejection: the change (a RunJob, say)
took effect, but the answer never arrived.

Faults apply to the Cloud Run API only, over both transports, never to ``/_emulator`` or the GCS emulator.

And the :class:`PreemptionSchedule`: maintenance preemptions arriving as a Poisson process
(exponential inter-arrival times with a given mean), each hitting one running task attempt
drawn at random. ``POST /_emulator/preemptions/schedule`` (or ``serve --preempt-every``)::

    {"meanSeconds": 30,      # mean time between preemptions (required, > 0)
     "seed": 1,              # arrival times and picks are drawn from generators seeded with it
     "graceSeconds": 10,     # SIGTERM-to-SIGKILL grace (default: the emulator's graceSeconds)
     "namePrefix": "projects/my-project/locations/us-central1/jobs/train",  # only these tasks
     "maxPreemptions": 0}    # stop after this many (0: no limit)

The arrival times depend on the seed only; the pick at an arrival is the seeded draw among
the attempts running then (sorted by task name), so a run is reproducible as far as task
timing is. An arrival with nothing running is counted as missed. Arrivals are at least
:data:`MIN_GAP_SECONDS` apart (a shorter draw is lengthened to it), so a tiny ``meanSeconds``
gives at most one arrival per gap instead of a thread spinning at one core. ``GET`` on the same path
reports the plan and every preemption so far (``{"active", "plan", "missed", "preemptions":
[{"scheduledAtSeconds", "atSeconds", "task", "attempt"}]}``); ``DELETE`` (or
``/_emulator/reset``) stops it.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from typing import Optional

from .exceptions import DeadlineExceeded, EmulatorError, InvalidArgument, ResourceExhausted, Unavailable

_ERRORS = {503: Unavailable, 429: ResourceExhausted}
_LOST_ANSWER_ERRORS = {500: EmulatorError, 504: DeadlineExceeded}
#: Shortest time between two scheduled preemptions (s). Each arrival takes the registry's lock,
#: which API requests and supervisor steps need too, and a preempted attempt is only replaced at
#: its supervisor's next step, so closer arrivals would find nothing new to preempt.
MIN_GAP_SECONDS = 0.01


@dataclasses.dataclass
class FaultConfig:
    """One fault configuration (see the module docstring for the JSON keys)."""

    fail_next: int = 0
    error_rate: float = 0.0
    codes: tuple = (503,)
    delay_seconds: float = 0.0
    seed: int = 0
    lose_answer_next: int = 0
    lose_answer_code: int = 500

    @classmethod
    def from_json(cls, data: dict) -> "FaultConfig":
        codes = tuple(data.get("codes", (503,)))
        if not codes or any(c not in _ERRORS for c in codes):
            raise InvalidArgument(f"codes: each must be one of {sorted(_ERRORS)}.")
        rate = float(data.get("errorRate", 0.0))
        if not 0.0 <= rate <= 1.0:
            raise InvalidArgument("errorRate: must be between 0 and 1.")
        lose_code = data.get("loseAnswerCode", 500)
        if lose_code not in _LOST_ANSWER_ERRORS:
            raise InvalidArgument(f"loseAnswerCode: must be one of {sorted(_LOST_ANSWER_ERRORS)}.")
        lose_next = data.get("loseAnswerNext", 0)
        if isinstance(lose_next, bool) or not isinstance(lose_next, int) or lose_next < 0:
            raise InvalidArgument("loseAnswerNext: must be an integer >= 0.")
        return cls(int(data.get("failNext", 0)), rate, codes, float(data.get("delaySeconds", 0.0)),
                   int(data.get("seed", 0)), lose_next, lose_code)


class ApiFaults:
    """Decides, per API request, whether to delay it and whether to fail it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.configure(FaultConfig())

    def configure(self, config: FaultConfig) -> None:
        with self._lock:
            self.config = config
            self._remaining = config.fail_next
            self._lose_remaining = config.lose_answer_next
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

    def lost_answer(self, mutating: bool) -> EmulatorError | None:
        """:param mutating: whether the request changes state (over REST: a POST, PATCH or
            DELETE; see :attr:`~.rpcs.Rpc.mutating`).
        :return: the error that replaces the answer of a request already applied (while
            ``loseAnswerNext`` lasts, for mutating requests only), or ``None``."""
        with self._lock:
            if not mutating or self._lose_remaining <= 0:
                return None
            self._lose_remaining -= 1
            code = self.config.lose_answer_code
            return _LOST_ANSWER_ERRORS[code](f"Injected fault: the request was applied but its answer was lost ({code}).")


@dataclasses.dataclass
class PreemptionPlan:
    """A preemption schedule (see the module docstring for the JSON keys)."""

    mean_seconds: float
    seed: int = 0
    grace_seconds: Optional[float] = None
    name_prefix: str = ""
    max_preemptions: int = 0

    @classmethod
    def from_json(cls, data: dict) -> "PreemptionPlan":
        try:
            mean = float(data["meanSeconds"])
            grace = None if data.get("graceSeconds") is None else float(data["graceSeconds"])
            plan = cls(mean, int(data.get("seed", 0)), grace, str(data.get("namePrefix", "")),
                       int(data.get("maxPreemptions", 0)))
        except KeyError:
            raise InvalidArgument("meanSeconds: required.") from None
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(f"Invalid preemption schedule: {exc}") from None
        if not plan.mean_seconds > 0:
            raise InvalidArgument("meanSeconds: must be greater than 0.")
        if plan.max_preemptions < 0 or (plan.grace_seconds is not None and plan.grace_seconds < 0):
            raise InvalidArgument("maxPreemptions and graceSeconds: must not be negative.")
        return plan

    def arrival_offsets(self):
        """Seconds from the schedule's start of each preemption arrival (an endless generator;
        exponential inter-arrival times drawn from a generator seeded with :attr:`seed` only, each
        at least :data:`MIN_GAP_SECONDS`)."""
        arrivals, offset = random.Random(f"arrivals-{self.seed}"), 0.0
        while True:
            offset += max(MIN_GAP_SECONDS, arrivals.expovariate(1.0 / self.mean_seconds))
            yield offset

    def to_json(self) -> dict:
        return {"meanSeconds": self.mean_seconds, "seed": self.seed, "graceSeconds": self.grace_seconds,
                "namePrefix": self.name_prefix, "maxPreemptions": self.max_preemptions}


class PreemptionSchedule:
    """Runs at most one :class:`PreemptionPlan` at a time in a daemon thread.

    :param registry: the emulator's :class:`~.backend.Registry` (its lock, its running attempts
        via ``preemptible(prefix)`` and its default grace).
    """

    def __init__(self, registry) -> None:
        self._registry = registry
        self._lock = threading.Lock()
        self._stop: Optional[threading.Event] = None
        self.plan: Optional[PreemptionPlan] = None
        self.events: list = []
        self.missed = 0

    def start(self, plan: PreemptionPlan) -> dict:
        """Replace any running schedule with ``plan``; its clock starts now."""
        self.stop()
        with self._lock:
            self.plan, self.events, self.missed = plan, [], 0
            self._stop = stop = threading.Event()
        threading.Thread(target=self._run, args=(plan, stop), name="preemption-schedule", daemon=True).start()
        return self.status()

    def stop(self) -> dict:
        """Stop the schedule (events so far stay readable)."""
        with self._lock:
            if self._stop is not None:
                self._stop.set()
                self._stop = None
        return self.status()

    def status(self) -> dict:
        with self._lock:
            return {"active": self._stop is not None, "plan": self.plan.to_json() if self.plan else None,
                    "preemptions": list(self.events), "missed": self.missed}

    def _run(self, plan: PreemptionPlan, stop: threading.Event) -> None:
        picks, started = random.Random(f"picks-{plan.seed}"), time.monotonic()
        for offset in plan.arrival_offsets():
            if stop.wait(max(0.0, started + offset - time.monotonic())):
                return
            fired = self._fire(plan, picks, (round(offset, 3), round(time.monotonic() - started, 3)), stop)
            if fired and plan.max_preemptions and fired >= plan.max_preemptions:
                with self._lock:
                    if self._stop is stop:
                        self._stop = None
                return

    def _fire(self, plan: PreemptionPlan, picks: random.Random, at: tuple, stop: threading.Event) -> int:
        """Preempt one drawn attempt; return the number of preemptions so far (0 if missed).

        :param at: ``(scheduled, actual)`` seconds since the schedule started.
        """
        registry = self._registry
        with registry.cond:
            candidates = registry.preemptible(plan.name_prefix)
            with self._lock:
                if stop.is_set():
                    return 0
                if not candidates:
                    self.missed += 1
                    return 0
                supervisor, index, attempt = picks.choice(candidates)
                grace = registry.config.policy.grace_seconds if plan.grace_seconds is None else plan.grace_seconds
                supervisor.preempt(index, grace)
                self.events.append({"scheduledAtSeconds": at[0], "atSeconds": at[1], "task": attempt.task.name,
                                    "attempt": attempt.number})
                count = len(self.events)
            registry.cond.notify_all()
            return count
