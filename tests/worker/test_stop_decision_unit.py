"""The one stop decision (``preemption.decide_stop``) and the one parse of the grace period and
the task deadline (``config.StopTiming``), table-driven, and the check of a grace period or timeout a caller gives, by every way in. Cost: about 1 s."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from gpu_resilience_worker.config import StopTiming
from gpu_resilience_worker.errors import ConfigError
from gpu_resilience_worker.preemption import CONTINUE, EXIT, NO_TIME_TO_SAVE, SAVE, PreemptionWatcher, decide_stop

#: (case, keyword arguments beyond the base, action, reason's start)
DECISIONS = [
    ("no stop", {"requested": False}, CONTINUE, "no stop requested"),
    ("fits", {}, SAVE, "saving at the stop: it fits"),
    ("does not fit: 1.5 x 7 + 0.5 > 10", {"estimated_save_seconds": 7.0}, EXIT, NO_TIME_TO_SAVE),
    ("just fits: 1.5 x 3 + 0.5 < 5.01", {"estimated_save_seconds": 3.0, "remaining_grace": 5.01}, SAVE, "saving"),
    ("just misses: 1.5 x 3 + 0.5 = 5", {"estimated_save_seconds": 3.0, "remaining_grace": 5.0}, EXIT,
     NO_TIME_TO_SAVE),
    ("always saves even without time", {"mode": "always", "remaining_grace": 0.0}, SAVE, "saving at the stop (p"),
    ("never saves", {"mode": "never"}, EXIT, "no checkpoint at the stop (preemption_save never)"),
    ("already committed", {"last_committed": 40}, EXIT, "nothing new to checkpoint"),
    ("step 0", {"step": 0, "last_committed": None}, EXIT, "nothing new to checkpoint"),
    ("torn step, even with always", {"step_torn": True, "mode": "always"}, EXIT,
     "no checkpoint at the stop: the interrupted step"),
    ("save in flight abandoned", {"save_abandoned": True}, EXIT, "no checkpoint at the stop: the save in flight"),
    ("checkpointing off", {"checkpointing": False, "mode": "always"}, EXIT,
     "no checkpoint at the stop (checkpointing off)"),
    ("off wins over nothing new", {"checkpointing": False, "last_committed": 40}, EXIT, "no checkpoint at the stop ("),
]
BASE = {"requested": True, "step": 40, "last_committed": 30, "estimated_save_seconds": 1.0,
        "remaining_grace": 10.0, "mode": "deadline"}


@pytest.mark.parametrize("case, changes, action, reason", DECISIONS, ids=[d[0] for d in DECISIONS])
def test_decide_stop(case: str, changes: dict, action: str, reason: str) -> None:
    decision = decide_stop(**{**BASE, **changes})
    assert decision.action == action and decision.reason.startswith(reason), (case, decision)


def test_decide_stop_refuses_an_unknown_mode_by_name() -> None:
    with pytest.raises(ValueError, match=r"preemption_save must be one of \('deadline', 'always', 'never'\)"):
        decide_stop(**{**BASE, "mode": "sometimes"})


#: (environment, explicit grace, explicit timeout, expected (grace, timeout) or the error's text)
TIMINGS = [
    ({}, None, None, (10.0, None)),
    ({"PREEMPTION_GRACE_SECONDS": "4.5", "TASK_TIMEOUT_SECONDS": "3600"}, None, None, (4.5, 3600.0)),
    ({"PREEMPTION_GRACE_SECONDS": "0"}, None, None, (0.0, None)),
    ({"PREEMPTION_GRACE_SECONDS": "", "TASK_TIMEOUT_SECONDS": ""}, None, None, (10.0, None)),
    ({"PREEMPTION_GRACE_SECONDS": "soon"}, 3.0, 60.0, (3.0, 60.0)),  # given values win, the variable is not read
    ({"PREEMPTION_GRACE_SECONDS": "soon"}, None, None, "PREEMPTION_GRACE_SECONDS='soon' is not a number"),
    ({"PREEMPTION_GRACE_SECONDS": "inf"}, None, None, "PREEMPTION_GRACE_SECONDS='inf' must be a number of seconds >= 0"),
    ({"PREEMPTION_GRACE_SECONDS": "-1"}, None, None, "PREEMPTION_GRACE_SECONDS='-1' must be"),
    ({"TASK_TIMEOUT_SECONDS": "0"}, None, None, "TASK_TIMEOUT_SECONDS='0' must be a number of seconds > 0"),
    ({"TASK_TIMEOUT_SECONDS": "nan"}, None, None, "TASK_TIMEOUT_SECONDS='nan' must be"),
    ({"TASK_TIMEOUT_SECONDS": "1e300"}, None, None, "TASK_TIMEOUT_SECONDS='1e300' must be"),
]


#: (grace_seconds, task_timeout_seconds, the error's text or None): the ranges of the variables.
CHECKS = [
    (0, None, None), (4.5, 3600, None), (None, None, None), (604800, 604800, None),
    (-1, None, "grace_seconds must be a finite number >= 0"), (float("nan"), None, "grace_seconds must be"),
    ("10", None, "grace_seconds must be a finite number"), (1e300, None, "grace_seconds must be <= 604800"),
    (None, 0, "task_timeout_seconds must be a finite number > 0"), (None, 1e7, "task_timeout_seconds must be <="),
]


@pytest.mark.parametrize("grace, timeout, error", CHECKS)
def test_every_way_in_checks_a_given_grace_and_timeout_by_one_rule(tmp_path: Path, grace: object, timeout: object,
                                                                   error: str | None) -> None:
    """The loop and the framework store take the variables' ranges for the values a caller gives."""
    from gpu_resilience_worker.artifacts import ArtifactCheckpoints
    from gpu_resilience_worker.loop import ResilientLoop

    makers = [lambda: ResilientLoop({"m": torch.nn.Linear(1, 1)}, total_steps=1, folder=tmp_path,
                                    grace_seconds=grace, task_timeout_seconds=timeout)]
    if timeout is None:
        makers.append(lambda: ArtifactCheckpoints(tmp_path, prefix="checkpoint-", grace_seconds=grace))
    for make in makers:
        if error is None:
            make()
        else:
            with pytest.raises(ValueError, match=re.escape(error)):
                make()


@pytest.mark.parametrize("env, grace, timeout, expected", TIMINGS)
def test_stop_timing_from_env(env: dict, grace: float | None, timeout: float | None, expected: object) -> None:
    if isinstance(expected, str):
        with pytest.raises(ConfigError) as raised:
            StopTiming.from_env(env, grace_seconds=grace, task_timeout_seconds=timeout)
        assert str(raised.value).startswith(expected)
        return
    timing = StopTiming.from_env(env, grace_seconds=grace, task_timeout_seconds=timeout)
    assert (timing.grace_seconds, timing.task_timeout_seconds) == expected


def test_stop_timing_sets_the_watchers_grace_and_deadline() -> None:
    now = [100.0]
    watcher = PreemptionWatcher(clock=lambda: now[0])
    StopTiming(grace_seconds=4.0, task_timeout_seconds=30.0).apply(watcher)
    assert watcher.grace_seconds == 4.0
    assert watcher.deadline == watcher.started_at + 30.0 - 4.0  # min(grace, timeout / 2) before the timeout
    StopTiming().apply(watcher)
    assert watcher.deadline is None and watcher.grace_seconds == 10.0


def test_the_signal_handler_takes_no_lock_and_wakes_a_wait():
    """A handler runs on the main thread between two bytecodes, also while that thread holds a
    lock; one that took a lock (``threading.Event.set`` does) could wait for it forever, and the
    worker would then be killed at the grace period's end without its stop. The handler's calls
    into C are recorded: none may be a lock's; and a wait started after the signal returns at once."""
    import signal
    import sys
    import time

    watcher = PreemptionWatcher()
    watcher.install()
    calls: list[str] = []
    try:
        sys.setprofile(lambda frame, event, arg: calls.append(getattr(arg, "__qualname__", repr(arg)))
                       if event == "c_call" else None)
        try:
            watcher._handle(signal.SIGTERM, None)
        finally:
            sys.setprofile(None)
        started = time.monotonic()
        assert watcher.wait(30.0) is True and time.monotonic() - started < 5.0
    finally:
        watcher.uninstall()
    assert watcher.requested and watcher.signal_name == "SIGTERM"
    assert not [c for c in calls if "lock" in c.lower() or "acquire" in c.lower()], calls
