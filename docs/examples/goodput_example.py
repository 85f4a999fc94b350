"""The goodput account and the re-run budget, worked through one short history.

The "Goodput and the re-run budget" page shows this file and its output
(``goodput_example.out``); ``tests/unit/test_docs.py`` runs it and compares what it prints with
that file, so the page's numbers are the code's.
"""

from airflow_gpu_resilience.goodput import AttemptInput, account_task, format_table
from airflow_gpu_resilience.outcome import OutcomeClass, TaskOutcome
from airflow_gpu_resilience.rerun_budget import ExecutionProgress, ProgressBudget, decide_rerun

# [START howto_goodput_account]
# Task 0 of execution "train-x7k2p": attempt 0 is preempted, Cloud Run retries it as attempt 1.
# Times are seconds. Cloud Run keeps start and end times for a task's latest attempt only, so
# attempt 0's times come from its worker's events file (process_start to ended_at).
preempted = AttemptInput("train-x7k2p", 0, start=None, end=None, events={
    "process_start": 0.0, "first_step_at": 5.0,  # 5 s of start-up (imports, data, CUDA)
    "steps": 90, "step_seconds": 0.5,  # 90 steps of 0.5 s
    "save_blocking_seconds": 2.0,  # the loop waited 2 s on checkpoint saves
    "ended_at": 50.0,  # SIGTERM at 45 s: the final save committed, exit 143 at 50 s
})
resumed = AttemptInput("train-x7k2p", 1, start=60.0, end=120.0, events={
    "restore_start": 62.0, "restore_end": 64.0,  # 2 s to load the checkpoint of step 80
    "first_step_at": 70.0, "steps": 100, "step_seconds": 0.5,
    "steps_recomputed": 10,  # steps 81-90 were done before, past that checkpoint
    "save_blocking_seconds": 1.0,
})
account = account_task(0, [preempted, resumed])
print(format_table([account]))
# [END howto_goodput_account]
print()

# [START howto_rerun_budget]
# One Airflow task's executions, oldest first: the newest committed step of task 0 at each
# execution's start and end. Each was preempted after Cloud Run's retries ran out.
history = [
    ExecutionProgress("train-a", OutcomeClass.PREEMPTED, {}, {0: 400}),  # the first run: not a re-run
    ExecutionProgress("train-b", OutcomeClass.PREEMPTED, {0: 400}, {0: 800}),  # progress: a free re-run
    ExecutionProgress("train-c", OutcomeClass.PREEMPTED, {0: 800}, {0: 800}),  # no progress: 1 of 2
    ExecutionProgress("train-d", OutcomeClass.PREEMPTED, {0: 800}, {0: 800}),  # no progress: 2 of 2
]
task = TaskOutcome(index=0, attempts=4, outcome=OutcomeClass.PREEMPTED, exit_code=143)
for seen in range(1, len(history) + 1):
    budget = ProgressBudget(history[:seen], max_reruns_without_progress=2, max_total_reruns=48)
    decision = decide_rerun(task, reruns_used=seen - 1, progress=budget)
    print(f"after {history[seen - 1].name}: {decision.action.value}: {decision.reason}")
# [END howto_rerun_budget]
