"""Local Cloud Run Admin API v2 emulator for the unmodified ``google-cloud-run`` clients, over
REST and gRPC (their default transport), sync and async.

Start it::

    python -m cloud_run_emulator serve --port 8123 --grpc-port 8124 --gcs-port 9023 \\
        --data-dir DIR [--images FILE] [--grace-seconds 10] [--task-start-delay 0] \\
        [--no-preemption-consumes-retry] [--failed-execution-code 9] [--gpu-quota N] [--max-task-processes N] \\
        [--preempt-every MEAN_SECONDS --preempt-seed S [--preempt-prefix NAME]] \\
        [--volumes auto|fuse|folder] [--fuse-strict] \\
        [--read-quota-per-minute 600] [--write-quota-per-minute 60] [--quota-window-seconds 60]

It binds 127.0.0.1 only; its REST server answers only loopback ``Host`` values, refuses
cross-origin requests and non-JSON bodies, and reads at most 4 MiB of a body (see :mod:`.guards`);
its gRPC server speaks HTTP/2 gRPC only, which no browser page can send (see :mod:`.grpc_server`).
It prints one JSON ready line, ``{"ready": true, "endpoint": "http://127.0.0.1:PORT",
"grpcEndpoint": "127.0.0.1:PORT3", "gcsEndpoint": "http://127.0.0.1:PORT2", "dataDir": ...,
"pid": ..., "env": {"CLOUD_RUN_EMULATOR_HOST": "127.0.0.1:PORT3", "STORAGE_EMULATOR_HOST":
"http://127.0.0.1:PORT2"}}`` (port 0 picks a free one). SIGTERM or SIGINT stops it and every task process it
started; a hard-killed emulator takes them along (Linux). From Python use
:class:`~.process.EmulatorProcess`. Point clients at it with::

    run_v2.JobsClient(credentials=AnonymousCredentials(), transport="rest",
                      client_options={"api_endpoint": emu.endpoint})
    run_v2.JobsClient(transport=JobsGrpcTransport(channel=grpc.insecure_channel(emu.grpc_endpoint)))
    os.environ["CLOUD_RUN_EMULATOR_HOST"] = emu.grpc_endpoint  # this project's hooks: gRPC, anonymous
    os.environ["STORAGE_EMULATOR_HOST"] = emu.gcs_endpoint   # google-cloud-storage

Served (gRPC: see :mod:`.rpcs`; REST ``/v2``: see :mod:`.urls`): CreateJob, GetJob, ListJobs,
UpdateJob, DeleteJob, RunJob, GetExecution, ListExecutions, CancelExecution, DeleteExecution,
GetTask, ListTasks, and the operations mixin (Get, List, Wait, Delete). Enums are integers when the request carries
``$alt=json;enum-encoding=int``. Admin endpoints (``/_emulator``: health, reset, preempt,
preemptions/schedule, faults, transitions, quota, requests, logs, attempts) are listed in
:mod:`.app`; the image table format is in :mod:`.images`.

Request quota: as Cloud Run does, the emulator limits Admin API reads and writes per project and
region per minute (600 and 60 by default; 0 turns one off) and answers more with 429
``RESOURCE_EXHAUSTED`` and Google's quota error, on both transports; it counts every request per
method, readable at ``/_emulator/requests`` (see :mod:`.quota`). :class:`~.process.EmulatorProcess`
starts it with both quotas off unless asked.

Fault injection: ``POST /_emulator/preempt`` (or ``python -m cloud_run_emulator
preempt``) preempts one running task (SIGTERM, grace, SIGKILL, a failed attempt with the
maintenance status, retried per ``maxRetries``); ``POST /_emulator/preemptions/schedule`` or
``serve --preempt-every`` preempts random running tasks at seeded exponential intervals;
``POST /_emulator/faults`` fails or delays API requests (see :mod:`.faults`).

Each attempt's stdout and stderr go to their own file; ``logUri`` of an execution or task is
``{endpoint}/_emulator/logs/{name}``, which serves the attempts' logs one after another.

The Airflow google provider's own ``CloudRunHook`` honours no ``*_EMULATOR_HOST`` variable and
always opens a TLS channel on gRPC; see ``tests/emulator/google_provider_dags.py`` for how its
operators reach the emulator.

Module map (after moto): :mod:`.models` (resources, lifecycles), :mod:`.backend` (state per
project and location), :mod:`.supervisor` (one thread per execution), :mod:`.runtime` (child
processes), :mod:`.validation`, :mod:`.rpcs` (the methods, for both transports),
:mod:`.group_reaper` (attempts' process groups end with the emulator),
:mod:`.responses` / :mod:`.urls` / :mod:`.app` (REST), :mod:`.grpc_server` (gRPC),
:mod:`.exceptions`, :mod:`.faults`, :mod:`.quota` (request quotas and counters), :mod:`.gcs`
(in-process GCS emulator and mounts),
:mod:`.guards` (who may send what; paths stay inside the data folder),
:mod:`.server` and ``__main__`` (CLI).

Known differences from Cloud Run:

- No containers: an image maps to a local command; processes inherit the emulator's env.
- GCS volume paths are rewritten in env values, args and command (see :mod:`.runtime`) to the
  bucket's FUSE mount, which behaves like Cloud Storage FUSE (:mod:`.gcsfuse`: objects appear at
  ``close()``; staged writes, throttled rewrites, non-atomic renames and ``ESTALE`` are recorded
  and shown by ``/_emulator/attempts``, the logs and ``/_emulator/volumes``), or, without FUSE,
  to the bucket's folder (one line at start says which); the GCS emulator re-indexes a bucket's
  files before each Storage API request (see :mod:`.gcs`).
- No IAM (its methods answer UNIMPLEMENTED), secrets, probes, VPC,
  ``showDeleted``, execution tokens, Cloud Logging (``logUri`` points at the emulator).
- Preemption is an emulator event only: nothing in the v2 API models it; a preempted attempt
  gets ``status.code`` 14 and a maintenance message (the real text is unconfirmed).
- Attempts start through ``setpriv --pdeathsig KILL`` (util-linux) when it exists, so they die
  with a hard-killed emulator; without it a ``preexec_fn`` does the same, more slowly. The
  processes an attempt started die then too: a helper process SIGKILLs the attempts' process
  groups when the emulator's process ends (:mod:`.group_reaper`). On two cores 1,000 short
  tasks at parallelism 50 (``--max-task-processes 50``) run at about 180 per second
  (``benchmarks/bench_emulator.py``).
- All tasks share one machine: at most ``--max-task-processes`` task processes run at once over
  all executions (default 8); further tasks stay PENDING, as beyond
  ``parallelism``. ``/_emulator/health`` reports the bound, the processes running and the peak.
- The REST client maps errors by HTTP code only: INVALID_ARGUMENT and FAILED_PRECONDITION
  both raise ``google.api_core.exceptions.BadRequest`` (status in the JSON body), and
  ALREADY_EXISTS raises ``Conflict``; over gRPC each code raises its own class
  (``InvalidArgument``, ``FailedPrecondition``, ``AlreadyExists``), with the same message. A failed execution's LRO carries gRPC code 9 (so
  ``operation.result()`` raises ``FailedPrecondition``); the real code is unconfirmed.
"""

__version__ = "0.1.0"
