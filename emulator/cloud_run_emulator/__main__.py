"""Command line: ``python -m cloud_run_emulator {serve,preempt}``.

``serve --port 8123 --grpc-port 8124 --gcs-port 9023 --data-dir DIR [--images FILE] [--grace-seconds 10]
[--max-task-processes N] [--volumes auto|fuse|folder] [--fuse-strict] [--read-quota-per-minute 600]
[--write-quota-per-minute 60] [--quota-window-seconds 60]`` starts the emulator: REST on
``--port``, gRPC on ``--grpc-port`` (``CLOUD_RUN_EMULATOR_HOST`` is ``127.0.0.1:`` that port), the
GCS emulator on ``--gcs-port`` (0 picks a free port; the ready line says which);
``--preempt-every MEAN_SECONDS [--preempt-seed S] [--preempt-prefix NAME]`` also starts a seeded
preemption schedule (see :class:`~.faults.PreemptionSchedule`); ``--google-endpoint`` also stands in
for ``run.googleapis.com:443`` (see :mod:`.google_endpoint`). The Admin API request quotas per
project and region default to Cloud Run's (see :mod:`.quota`); 0 turns one off.

``preempt --endpoint URL --execution NAME [--task-index I] [--grace-seconds S]`` asks a running
emulator for a maintenance preemption and prints its JSON answer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .process import post_json
from .quota import QuotaSettings, checked_limit, checked_window


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m cloud_run_emulator")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the Cloud Run Admin API v2 emulator")
    serve.add_argument("--port", type=int, default=8123, help="REST API port on 127.0.0.1 (0: any free)")
    serve.add_argument("--grpc-port", type=int, default=8124,
                       help="gRPC API port on 127.0.0.1, for CLOUD_RUN_EMULATOR_HOST (0: any free)")
    serve.add_argument("--gcs-port", type=int, default=9023, help="GCS emulator port (0: any free)")
    serve.add_argument("--data-dir", type=Path, required=True, help="GCS objects and attempt logs")
    serve.add_argument("--images", type=Path, action="append", default=None,
                       help="image table JSON file; repeat to combine tables (earlier files win)")
    serve.add_argument("--grace-seconds", type=float, default=10.0, help="SIGTERM-to-SIGKILL grace")
    serve.add_argument("--failed-execution-code", type=int, default=9,
                       help="gRPC code of a failed execution's operation error (default 9)")
    serve.add_argument("--task-start-delay", type=float, default=0.0,
                       help="seconds before each task attempt starts (GPU instance start)")
    serve.add_argument("--preemption-consumes-retry", action=argparse.BooleanOptionalAction, default=True,
                       help="whether a preempted attempt uses up one of maxRetries (default: yes)")
    serve.add_argument("--gpu-quota", type=int, default=0,
                       help="GPU task attempts running at once per project and location (0: unlimited)")
    serve.add_argument("--max-task-processes", type=int, default=None,
                       help="task processes running at once on this machine, over all executions; further "
                            "tasks wait as pending (default: 8)")
    serve.add_argument("--preempt-every", type=float, default=0.0, metavar="MEAN_SECONDS",
                       help="seeded maintenance preemptions, exponential inter-arrival with this mean (0: off)")
    serve.add_argument("--preempt-seed", type=int, default=0, help="seed of the preemption schedule")
    serve.add_argument("--preempt-prefix", default="", help="only preempt tasks whose name starts with this")
    serve.add_argument("--volumes", choices=("auto", "fuse", "folder"),
                       default=os.environ.get("EMULATOR_VOLUMES", "auto"),
                       help="cloud-storage volumes as FUSE mounts with gcsfuse semantics, or plain folders "
                            "(default: $EMULATOR_VOLUMES or auto, FUSE when available)")
    serve.add_argument("--fuse-strict", action=argparse.BooleanOptionalAction,
                       default=os.environ.get("EMULATOR_FUSE_STRICT", "") not in ("", "0", "false"),
                       help="FUSE volumes: a write that would fall back to staging fails with EIO "
                            "(default: $EMULATOR_FUSE_STRICT)")
    serve.add_argument("--google-endpoint", action="store_true",
                       help="also stand in for run.googleapis.com:443 for clients that cannot be pointed elsewhere "
                            "(the google provider's CloudRunHook): the ready line's googleEndpointEnv leads gRPC "
                            "there through an HTTP CONNECT proxy and a CA made in DATA_DIR/google-tls")
    _add_quota_flags(serve)
    preempt = sub.add_parser("preempt", help="preempt a running task (maintenance event)")
    preempt.add_argument("--endpoint", required=True, help="e.g. http://127.0.0.1:8123")
    preempt.add_argument("--execution", required=True, help="full execution name")
    preempt.add_argument("--task-index", type=int, default=0)
    preempt.add_argument("--grace-seconds", type=float, default=None)
    return parser


def _add_quota_flags(serve: argparse.ArgumentParser) -> None:
    default = QuotaSettings()
    serve.add_argument("--read-quota-per-minute", type=int, default=default.reads_per_minute, metavar="N",
                       help="Admin API read requests (Get, List, WaitOperation) admitted per minute per project "
                            f"and region, over REST and gRPC; more get 429 RESOURCE_EXHAUSTED (default "
                            f"{default.reads_per_minute}, Cloud Run's; 0: off)")
    serve.add_argument("--write-quota-per-minute", type=int, default=default.writes_per_minute, metavar="N",
                       help="Admin API write requests (Create, Update, Delete, Run, Cancel) likewise (default "
                            f"{default.writes_per_minute}, Cloud Run's; 0: off)")
    serve.add_argument("--quota-window-seconds", type=float, default=default.window_seconds, metavar="S",
                       help="the quotas' sliding window; shorter only to make tests short (default 60)")


#: ``serve`` flags of :class:`~.quota.QuotaSettings`: flag -> (argument, check).
_QUOTA_FLAGS = {
    "--read-quota-per-minute": ("read_quota_per_minute", checked_limit),
    "--write-quota-per-minute": ("write_quota_per_minute", checked_limit),
    "--quota-window-seconds": ("quota_window_seconds", checked_window),
}


#: ``serve`` flags checked against :data:`~.runtime.POLICY_LIMITS`: flag -> (argument, policy setting).
_POLICY_FLAGS = {
    "--grace-seconds": ("grace_seconds", "grace_seconds"),
    "--task-start-delay": ("task_start_delay", "start_delay_seconds"),
    "--gpu-quota": ("gpu_quota", "gpu_quota"),
    "--failed-execution-code": ("failed_execution_code", "failed_execution_code"),
    "--max-task-processes": ("max_task_processes", "max_task_processes"),
}


def _check_serve_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit 2 with a usage error naming the flag and its allowed values, before anything starts."""
    import math

    from .runtime import policy_value

    for flag, (dest, attr) in _POLICY_FLAGS.items():
        if getattr(args, dest) is None:  # not given: the setting's default
            continue
        try:
            policy_value(attr, getattr(args, dest))
        except ValueError as exc:
            parser.error(f"{flag} {exc}")
    for flag, (dest, check) in _QUOTA_FLAGS.items():
        try:
            check(flag, getattr(args, dest))
        except ValueError as exc:
            parser.error(str(exc))
    for flag, port in (("--port", args.port), ("--grpc-port", args.grpc_port), ("--gcs-port", args.gcs_port)):
        if not 0 <= port <= 65535:
            parser.error(f"{flag} must be a port number from 0 to 65535 (0: any free port), got {port}")
    if not (math.isfinite(args.preempt_every) and args.preempt_every >= 0):
        parser.error(f"--preempt-every must be a finite number of seconds >= 0 (0: off), got {args.preempt_every!r}")


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        _check_serve_flags(parser, args)
        from .faults import PreemptionPlan
        from .runtime import RuntimePolicy
        from .server import ServeConfig, serve

        policy = RuntimePolicy(grace_seconds=args.grace_seconds, failed_execution_code=args.failed_execution_code,
                               start_delay_seconds=args.task_start_delay,
                               preemption_consumes_retry=args.preemption_consumes_retry, gpu_quota=args.gpu_quota)
        if args.max_task_processes is not None:
            policy.max_task_processes = args.max_task_processes
        plan = (PreemptionPlan(args.preempt_every, args.preempt_seed, name_prefix=args.preempt_prefix)
                if args.preempt_every > 0 else None)
        serve(ServeConfig(data_dir=args.data_dir, port=args.port, grpc_port=args.grpc_port, gcs_port=args.gcs_port,
                          images_file=args.images, policy=policy, preemptions=plan, volumes=args.volumes,
                          fuse_strict=args.fuse_strict, google_endpoint=args.google_endpoint,
                          quota=QuotaSettings(args.read_quota_per_minute, args.write_quota_per_minute,
                                              args.quota_window_seconds)))
        return 0
    payload = {"execution": args.execution, "taskIndex": args.task_index}
    if args.grace_seconds is not None:
        payload["graceSeconds"] = args.grace_seconds
    answer = post_json(args.endpoint.rstrip("/") + "/_emulator/preempt", payload)
    print(json.dumps(answer))
    return 1 if "error" in answer else 0


if __name__ == "__main__":
    sys.exit(main())
