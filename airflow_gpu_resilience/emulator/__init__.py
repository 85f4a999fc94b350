"""Local Cloud Run Admin API v2 emulator (jobs, executions, tasks, operations) with GCS volumes
backed by an in-process GCS emulator, task attempts run as local processes, and injectable
maintenance preemptions and API faults.

Start it with ``python -m airflow_gpu_resilience.emulator serve --port 0 --gcs-port 0
--data-dir DIR --images FILE``, or from Python with :class:`.process.EmulatorProcess`.
"""
