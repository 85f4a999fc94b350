"""Twenty deferred executions under a low Cloud Run read quota, the triggerer SIGKILLed midway.

Issue 36, must-show 2 and 4, on the deployment of ``tests/deployment/conftest.py`` (the stack the
other deployment tests use, started once). One DAG run of ``cloud_run_quota_sweep``
(``tests/deployment/dags/``): one execute task mapped over twenty existing jobs, deferrable, so
twenty executions of one project and region are watched by triggers in one triggerer. The
emulator admits 60 reads a minute in that region (Cloud Run's default is 600), and each job's
task is a tiny command that runs until the test releases it, so the test, not the clock,
decides when each execution ends:

1. all twenty execute tasks deferred, their triggers in the triggerer, every task running; the
   Cloud Run API requests of the region counted for a while in that steady state, when only the
   triggerer reads and nothing changes;
2. three executions' tasks preempted (Cloud Run retries them within the execution);
3. half the jobs released, and at once the triggerer SIGKILLed: those executions end while no
   triggerer runs; two more tasks preempted while it is down; the triggerer restarted;
4. once the restarted triggerer runs the remaining triggers, the other half released.

Asserted: the DAG run and every mapped task succeed in their first try (no try failed, from a
429 or anything else), each job ran exactly one execution (the emulator's own record), the
emulator answered 429 at least once (the quota was reached), and the preempted tasks were
retried within their execution. In the steady state the triggerer read only the region's
listing (ListExecutions), no execution or task of its own, at most half the quota a minute: one
trigger polling its execution (GetExecution and ListTasks every 3 s each) would make 800 reads a
minute for twenty. Apart from the run, no warning from the triggerer that its event loop was
blocked at a trigger start, over every trigger start in the session's deployment tests (the first
trigger of each triggerer process imports the Google clients); the count and longest block of
every such warning go to the session's timing table.

Executions are counted from the emulator's log folders and its admin endpoints, which the quota
does not count; the test's own Cloud Run API requests (creating the jobs) happen before the
quota is set.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from tests.deployment.conftest import record_timing, stack_sweep, unpause_when_parsed, wait_for
from tests.deployment.dags.cloud_run_quota_sweep import DAG_ID, JOBS, PROJECT, REGION

# serial (scripts/run_tests.sh runs it alone): a real Airflow deployment under faults, with
# wall-clock waits on its components.
pytestmark = [pytest.mark.e2e, pytest.mark.serial]

#: Admin API reads admitted per minute in the sweep's project and region.
READ_QUOTA_PER_MINUTE = 60
#: Any image of the bundled worker's table; each job's container command replaces its entrypoint.
IMAGE = "us-central1-docker.pkg.dev/local-project/ml/airflow-gpu-resilience-worker:latest"
#: Jobs (by map index) whose task is preempted while every trigger runs, and while none does
#: (jobs not yet released then: a released job's task may already have ended).
PREEMPT_WHILE_WATCHED = (0, 5, 12)
PREEMPT_WHILE_DOWN = (3, 7)
#: Jobs released just before the triggerer is killed: their executions end while it is down.
RELEASED_BEFORE_KILL = tuple(range(10, 20))
RELEASED_AFTER_RESTART = tuple(range(0, 10))
PAUSE_S = 5.0  # the triggerer stays down this long
#: Seconds the steady state is counted, after ``SETTLE_S`` s for the last triggers' first polls
#: (a trigger that subscribes wakes the shared watcher for a poll at once).
STEADY_WINDOW_S = 30.0
SETTLE_S = 3.0
#: Seconds after a trigger's start within which a blocked-loop warning counts as the start's: its
#: first run imports the Google clients (in a thread) and makes its first poll.
START_WINDOW_S = 10.0
_state = stack_sweep.state


class Sweep:
    """The sweep's DAG run on the stack, and what the REST API and the emulator said of it."""

    def __init__(self, stack) -> None:
        import airflow_client.client as client

        self.stack, self.emulator = stack, stack.emulator
        self.api = stack.api_client()
        self.runs = client.DagRunApi(self.api)
        self.client_module = client
        # one task, three retries, a command that waits for its release file
        self.jobs = stack_sweep.ReleasableJobs(stack.emulator, PROJECT, REGION, JOBS, stack.workdir / "sweep-release")
        self.run_id = "quota-sweep"
        self.results: dict = {}

    def release(self, indexes) -> None:
        self.jobs.release(JOBS[index] for index in indexes)

    def mapped(self) -> list:
        """The execute task's twenty mapped task instances, by map index."""
        return stack_sweep.mapped_task_instances(self.api, DAG_ID, self.run_id, "execute_job")

    def execution(self, index: int) -> str:
        return self.jobs.execution(JOBS[index])

    def preempt(self, indexes) -> None:
        for index in indexes:
            self.results.setdefault("preempted", {})[index] = self.jobs.preempt(JOBS[index], grace_seconds=1.0)

    def all_deferred_and_running(self) -> bool:
        """Every mapped task deferred with its trigger in a triggerer, every job's task running."""
        tis = self.mapped()
        if len(tis) != len(JOBS) or any(_state(ti.state) != "deferred" or ti.triggerer_job is None for ti in tis):
            return False
        running = self.emulator.task_processes()["running"]
        return running >= len(JOBS)

    def taken_over(self, before: set[int]) -> bool:
        """The restarted triggerer runs the triggers of every execution still waiting for its release."""
        tis = {ti.map_index: ti for ti in self.mapped()}
        return all(_state(tis[i].state) == "deferred" and tis[i].triggerer_job is not None
                   and tis[i].triggerer_job.id not in before for i in RELEASED_AFTER_RESTART)

    def run_state(self) -> str:
        return _state(self.runs.get_dag_run(DAG_ID, self.run_id).state)


def _region_requests(s: Sweep) -> dict[str, int]:
    """The emulator's count of Cloud Run API requests per method in the sweep's project and region
    (admitted and rejected alike)."""
    methods = stack_sweep.region_requests(s.emulator, PROJECT, REGION)
    return {method: tally["requests"] for method, tally in methods.items()}


def _steady_requests(s: Sweep) -> dict:
    """The region's requests per method over ``STEADY_WINDOW_S`` s while every execution runs
    unchanged and every execute task is deferred: then only the triggerer reads.

    :return: ``{"seconds": the window's length, "requests": {method: count}}`` (methods with none left out).
    """
    time.sleep(SETTLE_S)
    before = _region_requests(s)
    begin = time.monotonic()
    time.sleep(STEADY_WINDOW_S)
    after = _region_requests(s)
    seconds = time.monotonic() - begin
    made = {method: count - before.get(method, 0) for method, count in after.items() if count != before.get(method, 0)}
    return {"seconds": round(seconds, 2), "requests": made}


def _kill_and_restart_triggerer(s: Sweep) -> None:
    """Release half the jobs and SIGKILL the triggerer at once; preempt two tasks while it is
    down; restart it and wait until it runs the triggers of the jobs not yet released."""
    before = {ti.triggerer_job.id for ti in s.mapped() if ti.triggerer_job is not None}
    s.release(RELEASED_BEFORE_KILL)
    mark = time.monotonic()
    s.stack.kill_component("triggerer", signal.SIGKILL)
    s.preempt(PREEMPT_WHILE_DOWN)
    time.sleep(PAUSE_S)
    s.stack.start_component("triggerer")
    wait_for(lambda: s.taken_over(before), 180, "the restarted triggerer to run the waiting jobs' triggers",
             interval=1.0)
    s.results["takeover_seconds"] = round(time.monotonic() - mark, 1)
    record_timing("sweep: triggerer SIGKILL -> its triggers running again",
                  fault_to_recovery_s=s.results["takeover_seconds"], down_s=PAUSE_S)


def _drive(s: Sweep) -> None:
    s.runs.trigger_dag_run(DAG_ID, s.client_module.TriggerDAGRunPostBody(dag_run_id=s.run_id, logical_date=None))
    begin = time.monotonic()
    wait_for(s.all_deferred_and_running, 600, "all twenty execute tasks deferred with their jobs' tasks running",
             interval=1.0)
    record_timing("sweep: trigger -> twenty deferred", seconds=round(time.monotonic() - begin, 1))
    s.results["steady"] = _steady_requests(s)
    s.preempt(PREEMPT_WHILE_WATCHED)
    _kill_and_restart_triggerer(s)
    s.release(RELEASED_AFTER_RESTART)
    final = wait_for(lambda: (state := s.run_state()) in ("success", "failed") and state, 600,
                     "the sweep's DAG run to finish", interval=1.0)
    record_timing(f"sweep: trigger -> DAG run {final}", seconds=round(time.monotonic() - begin, 1))


@pytest.fixture(scope="module")
def sweep(stack):
    """The sweep's DAG run, driven to its end (see the module docstring); the emulator's
    settings restored and every job released afterwards, also after a failure."""
    s = Sweep(stack)
    unpause_when_parsed(s.api, DAG_ID)
    s.jobs.deploy(IMAGE)
    # room for twenty task processes at once, the read quota on, the counters zeroed
    before = stack_sweep.configure_emulator(stack.emulator, len(JOBS) + 4, READ_QUOTA_PER_MINUTE)
    try:
        _drive(s)
        s.results["requests"] = stack.emulator.requests(project=PROJECT, region=REGION)
    finally:
        s.release(range(len(JOBS)))
        stack_sweep.restore_emulator(stack.emulator, before)
    s.results["run_state"] = s.run_state()
    s.results["tis"] = {ti.map_index: (_state(ti.state), ti.try_number) for ti in s.mapped()}
    s.results["executions"] = {job: s.jobs.execution_ids(job) for job in JOBS}
    (stack.workdir / "sweep.json").write_text(json.dumps(s.results, indent=2, default=str))
    return s


def test_twenty_deferred_executions_under_a_low_read_quota_each_run_once(sweep) -> None:
    r = sweep.results
    assert r["run_state"] == "success", r
    # no try failed: every mapped task succeeded in its first try (a failed try would be retried)
    assert r["tis"] == {index: ("success", 1) for index in range(len(JOBS))}, r["tis"]
    duplicates = {job: found for job, found in r["executions"].items() if len(found) != 1}
    assert not duplicates, f"jobs without exactly one execution: {duplicates}"
    rejected = r["requests"]["total"]["quotaExceeded"]
    assert rejected > 0, f"the {READ_QUOTA_PER_MINUTE}/min read quota was never reached: {r['requests']}"


def test_while_nothing_changes_the_triggerer_reads_only_the_region_listing(sweep) -> None:
    """The shared watcher: one ListExecutions of the region per poll (every 3 s), no per-execution
    reads while no count changes. A busier machine only spaces the polls further apart (the
    watcher waits its interval after each poll), so the rate cannot pass its bound from load."""
    steady = sweep.results["steady"]
    assert set(steady["requests"]) == {"ListExecutions"}, steady
    per_minute = steady["requests"]["ListExecutions"] * 60 / steady["seconds"]
    assert per_minute <= READ_QUOTA_PER_MINUTE / 2, steady


def test_preempted_tasks_were_retried_within_their_execution(sweep) -> None:
    preempted = sweep.results["preempted"]
    assert sorted(preempted) == sorted(PREEMPT_WHILE_WATCHED + PREEMPT_WHILE_DOWN)
    for index in preempted:
        attempts = sorted(sweep.emulator.attempts(sweep.execution(index)), key=lambda a: a["attempt"])
        reasons = [a.get("stopReason") for a in attempts]
        assert reasons[0] == "preempted" and reasons[-1] is None and attempts[-1]["exitCode"] == 0, attempts


def test_no_blocked_event_loop_warning_from_the_triggerer_at_a_trigger_start(sweep) -> None:
    """Issue 36 must-show 4, over every start of the triggerer and every trigger start in this
    session's deployment tests (the campaign's too, when it ran before). Airflow's triggerer warns
    when its event loop did not run for longer than ``[triggerer] blocked_main_thread_warning_threshold``;
    the first trigger of a triggerer process imports the Google clients, whose allocations would
    start a full garbage collection that holds the loop (the trigger pauses the collector for that
    import). A warning is a trigger start's when it ends within :data:`START_WINDOW_S` of one;
    every warning's count and the longest block go to the timing table (a warning away from any
    start follows the machine's load)."""
    log = Path(sweep.stack.workdir / "logs" / "triggerer.log").read_text(errors="replace")
    assert log.count("Starting the triggerer") >= 2, "the triggerer's log does not show its restart"
    warnings = stack_sweep.blocked_loop_warnings(log)
    assert len(warnings) == log.count(stack_sweep.BLOCKED_LOOP_MESSAGE), "a warning without its time or seconds"
    record_timing("triggerer: blocked-event-loop warnings (count, longest s)", executions=len(warnings),
                  seconds=max((blocked for _, blocked in warnings), default=0.0))
    starts = stack_sweep.trigger_starts(sweep.stack.workdir / "airflow-home" / "logs")
    # the sweep's twenty triggers, and again the ten the restarted triggerer took over
    assert len(starts) >= len(JOBS) + len(RELEASED_AFTER_RESTART), starts
    at_start = [(at, blocked) for at, blocked in warnings if any(0 <= at - s <= START_WINDOW_S for s in starts)]
    assert not at_start, f"(epoch s, blocked s) within {START_WINDOW_S} s of a trigger start: {at_start}"
