"""Typed Cloud Run GPU job specification: every validation rule, and the ``run_v2.Job`` it maps to.

Pure: no I/O, no clients. :class:`GpuJobSpec` mirrors::

    gcloud beta run jobs deploy JOB --image IMAGE --gpu 1 --gpu-type nvidia-l4 \\
        --no-gpu-zonal-redundancy --cpu 4 --memory 16Gi --task-timeout 168h --max-retries 3 \\
        --service-account SA \\
        --add-volume name=checkpoint-volume,type=cloud-storage,bucket=BUCKET \\
        --add-volume-mount volume=checkpoint-volume,mount-path=/checkpoints

Sources of the rules (checked 2026):

- GPU types and minimums: https://cloud.google.com/run/docs/configuring/jobs/gpu
  (L4: at least 4 vCPU and 16 GiB; RTX PRO 6000 Blackwell, Preview: at least 20 vCPU and 80 GiB;
  exactly one GPU per instance).
- Retries: https://cloud.google.com/run/docs/configuring/max-retries (0-10, default 3, per task).
- Task timeout: https://cloud.google.com/run/docs/configuring/task-timeout (maximum 168 h; GPU
  task timeouts above 1 h are the Preview "long running GPU jobs" feature).
- Job names: https://cloud.google.com/run/docs/create-jobs (lowercase letters, digits and
  dashes, starting with a letter, not ending with a dash, at most 63 characters).
- Bucket names: https://cloud.google.com/storage/docs/buckets#naming.
- Reserved environment variables: https://cloud.google.com/run/docs/container-contract#jobs-env-vars.
"""

from __future__ import annotations

import ipaddress
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from google.api import launch_stage_pb2
from google.cloud import run_v2
from google.protobuf import duration_pb2

from airflow_gpu_resilience.mount_options import parse_mount_options

#: Supported GPU types -> (minimum vCPU, minimum memory GiB, needs a preview launch stage).
GPU_TYPES: Mapping[str, tuple[float, float, bool]] = {
    "nvidia-l4": (4.0, 16.0, False),
    "nvidia-rtx-pro-6000": (20.0, 80.0, True),
}
#: Maximum task attempt timeout, seconds (168 h).
MAX_TASK_TIMEOUT_SECONDS = 168 * 3600
#: GPU task timeouts above this many seconds are a Preview feature (launch stage BETA).
GA_GPU_TASK_TIMEOUT_SECONDS = 3600
#: Allowed ``max_retries`` range (inclusive).
MAX_RETRIES_RANGE = (0, 10)
#: Maximum tasks per execution.
MAX_TASK_COUNT = 10_000
#: Name of the Cloud Storage volume that holds checkpoints.
CHECKPOINT_VOLUME = "checkpoint-volume"
#: Environment variable that tells the worker where the checkpoint root is.
CHECKPOINT_DIR_ENV = "CHECKPOINT_DIR"
#: Environment variable that tells the worker its attempt's task timeout (seconds), so that it
#: checkpoints and exits 143 shortly before Cloud Run stops it.
TASK_TIMEOUT_ENV = "TASK_TIMEOUT_SECONDS"
#: Environment variables Cloud Run sets itself; users cannot set them.
RESERVED_ENV = frozenset(
    {
        "CLOUD_RUN_JOB",
        "CLOUD_RUN_EXECUTION",
        "CLOUD_RUN_TASK_INDEX",
        "CLOUD_RUN_TASK_ATTEMPT",
        "CLOUD_RUN_TASK_COUNT",
    }
)
#: Label key prefixes Cloud Run rejects.
RESERVED_LABEL_PREFIXES = (
    "run.googleapis.com",
    "cloud.googleapis.com",
    "serving.knative.dev",
    "autoscaling.knative.dev",
)

_JOB_NAME_RE = re.compile(r"^[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?$")
_BUCKET_CHARS_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*[a-z0-9]$")
_LABEL_KEY_RE = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")
_LABEL_VALUE_RE = re.compile(r"^[a-z0-9_-]{0,63}$")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_QUANTITY_RE = re.compile(r"^(?P<num>\d+(?:\.\d+)?)(?P<unit>[KMGT]i?|k|m)?$")
_MEMORY_UNITS = {
    None: 1,
    "k": 1000,
    "K": 1000,
    "M": 1000**2,
    "G": 1000**3,
    "T": 1000**4,
    "Ki": 1024,
    "Mi": 1024**2,
    "Gi": 1024**3,
    "Ti": 1024**4,
}


def parse_cpu(value: str) -> float:
    """Parse a Cloud Run CPU limit (``"4"``, ``"4.5"``, ``"4000m"``) into vCPUs.

    :param value: the CPU limit as Cloud Run accepts it.
    :return: the number of vCPUs.
    :raises ValueError: if the value is not a CPU quantity.
    """
    match = _QUANTITY_RE.match(str(value).strip())
    if not match or match["unit"] not in (None, "m"):
        raise ValueError(f"cpu={value!r} is not a CPU quantity; use e.g. '4', '8' or '4000m'")
    number = float(match["num"])
    return number / 1000 if match["unit"] == "m" else number


def parse_memory_gib(value: str) -> float:
    """Parse a Kubernetes-style memory quantity (``"16Gi"``, ``"16384Mi"``, ``"17G"``) into GiB.

    :param value: the memory limit as Cloud Run accepts it.
    :return: the amount in GiB (2**30 bytes).
    :raises ValueError: if the value is not a memory quantity.
    """
    match = _QUANTITY_RE.match(str(value).strip())
    if not match or match["unit"] == "m":
        raise ValueError(f"memory={value!r} is not a memory quantity; use e.g. '16Gi' or '32Gi'")
    return float(match["num"]) * _MEMORY_UNITS[match["unit"]] / 1024**3


def validate_job_name(name: str) -> None:
    """Check a Cloud Run job name: lowercase letters, digits and ``-``, at most 63 characters.

    It must start with a letter and must not end with a dash (Cloud Run resource naming rules,
    https://cloud.google.com/run/docs/create-jobs).

    :param name: the job id, not the full resource name.
    :raises ValueError: naming the rule that the name breaks.
    """
    if not isinstance(name, str) or not _JOB_NAME_RE.match(name):
        raise ValueError(
            f"name={name!r} is not a valid Cloud Run job name: use 1-63 lowercase letters, "
            "digits and '-', starting with a letter and not ending with '-'"
        )


def validate_bucket_name(bucket: str) -> None:
    """Check a Cloud Storage bucket name against the GCS naming rules.

    Rules (https://cloud.google.com/storage/docs/buckets#naming): lowercase letters, digits,
    ``-``, ``_`` and ``.``; starts and ends with a letter or digit; 3-63 characters, or up to 222
    with dots where each dot-separated part is at most 63; not an IPv4 address; does not start
    with ``goog`` and does not contain ``google`` (or the ``g00gle`` misspelling).

    :param bucket: the bucket name, without ``gs://``.
    :raises ValueError: naming the rule that the name breaks.
    """
    problem = _bucket_name_problem(bucket)
    if problem:
        raise ValueError(
            f"checkpoint_bucket={bucket!r} is not a valid Cloud Storage bucket name: {problem}"
        )


def _bucket_name_problem(bucket: str) -> str | None:
    if not isinstance(bucket, str) or not _BUCKET_CHARS_RE.match(bucket):
        return (
            "use lowercase letters, digits, '-', '_' and '.', starting and ending with a "
            "letter or digit (no 'gs://' prefix)"
        )
    max_len = 222 if "." in bucket else 63
    if not 3 <= len(bucket) <= max_len:
        return f"length must be 3-{max_len} characters"
    if any(len(part) > 63 or not part for part in bucket.split(".")):
        return "each dot-separated part must be 1-63 characters"
    try:
        ipaddress.IPv4Address(bucket)
        return "must not be an IP address"
    except ValueError:
        pass
    if bucket.startswith("goog") or "google" in bucket or "g00gle" in bucket:
        return "must not start with 'goog' or contain 'google'"
    return None


def _check_range(name: str, value: int, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name}={value!r} is out of range: allowed integers are {low}-{high}")


@dataclass(frozen=True, kw_only=True)
class GpuJobSpec:
    """A Cloud Run job with one GPU per task and a Cloud Storage checkpoint volume.

    Construction validates every field (see :meth:`validate`), so an invalid spec never exists.

    :param name: job id (not the full resource name), Cloud Run naming rules.
    :param image: container image URI; must not be empty.
    :param command: container entrypoint override; empty keeps the image's ENTRYPOINT.
    :param args: container arguments; empty keeps the image's CMD.
    :param env: environment variables; ``CLOUD_RUN_*`` names are reserved. ``CHECKPOINT_DIR``
        is set to ``checkpoint_mount_path`` when a checkpoint bucket is given, and
        ``TASK_TIMEOUT_SECONDS`` to ``task_timeout`` always (a value of your own must equal it).
    :param cpu: vCPU limit (default ``"4"``); at least the GPU type's minimum. A number is
        turned into its string form.
    :param memory: memory limit (default ``"16Gi"``); at least the GPU type's minimum (GiB). A
        number means bytes.
    :param gpu_type: one of :data:`GPU_TYPES` (default ``"nvidia-l4"``).
    :param gpu_count: GPUs per instance; Cloud Run supports exactly 1 (default).
    :param gpu_zonal_redundancy: reserve failover capacity across zones (default ``False``, which
        sets ``gpuZonalRedundancyDisabled=true`` like ``--no-gpu-zonal-redundancy``).
    :param task_timeout: per-attempt task timeout in seconds (default 3600); 1 to 604800 (168 h).
        Above 3600 s the job uses the Preview launch stage (BETA).
    :param max_retries: Cloud Run retries per task, 0-10 (default 3). 0 emits a warning: a
        preempted task then fails its execution at once and only the operator's re-runs apply.
    :param task_count: tasks per execution, 1-10000 (default 1).
    :param parallelism: maximum tasks running at once, 0 = as many as possible (default 0).
    :param service_account: email of the service account the tasks run as, or ``None``.
    :param checkpoint_bucket: Cloud Storage bucket mounted for checkpoints, or ``None`` for no
        volume (a warning is emitted: work is then lost on preemption).
    :param checkpoint_mount_path: absolute mount path of the bucket (default ``/checkpoints``).
    :param mount_options: Cloud Storage FUSE flags of the checkpoint volume without the leading
        ``--`` (``volumes[].gcs.mountOptions``), e.g. ``["rename-dir-limit=100"]``; names from
        :data:`~airflow_gpu_resilience.mount_options.GCSFUSE_MOUNT_OPTIONS`, each at most once (default none).
    :param labels: job labels (GCP label rules; Cloud Run's reserved prefixes are rejected).
    :raises ValueError: on the first invalid field, naming it and the allowed values.
    """

    name: str
    image: str
    command: Sequence[str] = ()
    args: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    cpu: str = "4"
    memory: str = "16Gi"
    gpu_type: str = "nvidia-l4"
    gpu_count: int = 1
    gpu_zonal_redundancy: bool = False
    task_timeout: int = 3600
    max_retries: int = 3
    task_count: int = 1
    parallelism: int = 0
    service_account: str | None = None
    checkpoint_bucket: str | None = None
    checkpoint_mount_path: str = "/checkpoints"
    mount_options: Sequence[str] = ()
    labels: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("command", "args"):  # a lone string would become one item per character
            value = getattr(self, name)
            if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not all(
                    isinstance(item, str) for item in value):
                raise ValueError(f"{name}={value!r} must be a list of strings, e.g. ['train', '--steps=600']")
        if self.service_account is not None and not isinstance(self.service_account, str):
            raise ValueError(f"service_account={self.service_account!r} must be a service account email (a string)")
        # Freeze the collections so that the spec is hashable-ish and cannot change under us.
        object.__setattr__(self, "command", tuple(self.command))
        object.__setattr__(self, "args", tuple(self.args))
        object.__setattr__(self, "env", dict(self.env))
        object.__setattr__(self, "labels", dict(self.labels))
        for name in ("cpu", "memory"):  # rendered templates may give numbers: 4 -> "4"
            value = getattr(self, name)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                text = str(int(value)) if float(value).is_integer() else f"{value:g}"
                object.__setattr__(self, name, text)
        self.validate()

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> GpuJobSpec:
        """Build a spec from a mapping (for example a rendered operator argument).

        :param values: field names to values; unknown keys are rejected.
        :return: the validated spec.
        :raises ValueError: on an unknown key or an invalid value.
        """
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown GpuJobSpec field(s) {unknown}; allowed: {sorted(known)}")
        return cls(**values)

    def validate(self) -> None:
        """Check every field; called by the constructor.

        :raises ValueError: on the first invalid field, naming it and the allowed values.
        """
        validate_job_name(self.name)
        if not isinstance(self.image, str) or not self.image.strip():
            raise ValueError("image must be a non-empty container image URI")
        self._validate_gpu()
        self._validate_resources()
        if isinstance(self.task_timeout, bool) or not isinstance(self.task_timeout, int):
            raise ValueError(f"task_timeout={self.task_timeout!r} must be an integer of seconds")
        if not 0 < self.task_timeout <= MAX_TASK_TIMEOUT_SECONDS:
            raise ValueError(
                f"task_timeout={self.task_timeout} s is out of range: allowed 1-"
                f"{MAX_TASK_TIMEOUT_SECONDS} seconds (168 h)"
            )
        _check_range("max_retries", self.max_retries, *MAX_RETRIES_RANGE)
        _check_range("task_count", self.task_count, 1, MAX_TASK_COUNT)
        _check_range("parallelism", self.parallelism, 0, MAX_TASK_COUNT)
        self._validate_checkpoint()
        self._validate_env()
        self._validate_labels()
        if self.max_retries == 0:
            warnings.warn(
                "max_retries=0: a preempted task is not retried inside its execution; only the "
                "execute operator's preemption re-runs apply",
                UserWarning,
                stacklevel=4,
            )

    def _validate_gpu(self) -> None:
        if self.gpu_type not in GPU_TYPES:
            raise ValueError(f"gpu_type={self.gpu_type!r} is not supported; allowed: {sorted(GPU_TYPES)}")
        if self.gpu_count != 1:
            raise ValueError(f"gpu_count={self.gpu_count!r}: Cloud Run allows exactly 1 GPU per instance")
        if not isinstance(self.gpu_zonal_redundancy, bool):
            raise ValueError(f"gpu_zonal_redundancy={self.gpu_zonal_redundancy!r} must be True or False")

    def _validate_resources(self) -> None:
        min_cpu, min_gib, _ = GPU_TYPES[self.gpu_type]
        if parse_cpu(self.cpu) < min_cpu:
            raise ValueError(
                f"cpu={self.cpu!r} is below the {self.gpu_type} minimum of {min_cpu:g} vCPU"
            )
        if parse_memory_gib(self.memory) < min_gib:
            raise ValueError(
                f"memory={self.memory!r} is below the {self.gpu_type} minimum of {min_gib:g} GiB"
            )

    def _validate_checkpoint(self) -> None:
        if self.checkpoint_bucket is None:
            warnings.warn(
                "checkpoint_bucket is None: no checkpoint volume is mounted, so a preempted task "
                "restarts from scratch",
                UserWarning,
                stacklevel=5,
            )
        else:
            validate_bucket_name(self.checkpoint_bucket)
        path = self.checkpoint_mount_path
        if not isinstance(path, str) or not path.startswith("/") or path == "/" or "//" in path:
            raise ValueError(
                f"checkpoint_mount_path={path!r} must be an absolute path other than '/'"
            )
        self._validate_mount_options()

    def _validate_mount_options(self) -> None:
        options = self.mount_options
        if isinstance(options, (str, bytes)) or not isinstance(options, Sequence):
            raise ValueError(f"mount_options={options!r} must be a list of strings, e.g. ['rename-dir-limit=100']")
        object.__setattr__(self, "mount_options", tuple(options))
        parse_mount_options(options, "mount_options")
        if options and not self.checkpoint_bucket:
            raise ValueError("mount_options need checkpoint_bucket: they are the checkpoint volume's options")

    def _validate_env(self) -> None:
        for key, value in self.env.items():
            if not isinstance(key, str) or not _ENV_NAME_RE.match(key):
                raise ValueError(f"env name {key!r} is invalid: use letters, digits and '_'")
            if key in RESERVED_ENV:
                raise ValueError(f"env name {key!r} is reserved by Cloud Run: {sorted(RESERVED_ENV)}")
            if not isinstance(value, str):
                raise ValueError(f"env[{key!r}]={value!r} must be a string")
        own = self.env.get(CHECKPOINT_DIR_ENV)
        if self.checkpoint_bucket and own is not None and own != self.checkpoint_mount_path:
            raise ValueError(
                f"env[{CHECKPOINT_DIR_ENV!r}]={own!r} contradicts checkpoint_mount_path="
                f"{self.checkpoint_mount_path!r}; leave it unset, the spec sets it"
            )

        timeout = self.env.get(TASK_TIMEOUT_ENV)
        if timeout is not None and timeout != str(self.task_timeout):
            raise ValueError(
                f"env[{TASK_TIMEOUT_ENV!r}]={timeout!r} contradicts task_timeout={self.task_timeout}; "
                "leave it unset, the spec sets it"
            )

    def _validate_labels(self) -> None:
        for key, value in self.labels.items():
            if not isinstance(key, str) or key.startswith(RESERVED_LABEL_PREFIXES):
                raise ValueError(f"label {key!r} uses a prefix Cloud Run reserves: {RESERVED_LABEL_PREFIXES}")
            if not _LABEL_KEY_RE.match(key):
                raise ValueError(f"label key {key!r} is invalid: 1-63 of [a-z0-9_-], starting with a letter")
            if not isinstance(value, str) or not _LABEL_VALUE_RE.match(value):
                raise ValueError(f"label {key}={value!r} is invalid: 0-63 of [a-z0-9_-]")

    @property
    def needs_preview(self) -> bool:
        """Whether the job uses a Preview feature and so needs launch stage BETA.

        True for a Preview GPU type (RTX PRO 6000) or a GPU task timeout above 3600 s.
        """
        return GPU_TYPES[self.gpu_type][2] or self.task_timeout > GA_GPU_TASK_TIMEOUT_SECONDS

    def container_env(self) -> dict[str, str]:
        """The container's environment: ``env``, ``CHECKPOINT_DIR`` when a bucket is mounted, and
        ``TASK_TIMEOUT_SECONDS`` (the task timeout, for the worker's deadline-aware exit).

        :return: a new dict, in insertion order.
        """
        env = dict(self.env)
        if self.checkpoint_bucket:
            env[CHECKPOINT_DIR_ENV] = self.checkpoint_mount_path
        env[TASK_TIMEOUT_ENV] = str(self.task_timeout)
        return env

    def to_job(self) -> run_v2.Job:
        """Build the ``run_v2.Job`` for CreateJob/UpdateJob (``name`` is left for the hook to set).

        :return: a new Job message.
        """
        job = run_v2.Job(labels=self.labels, template=self._execution_template())
        if self.needs_preview:
            job.launch_stage = launch_stage_pb2.LaunchStage.BETA
        return job

    def _execution_template(self) -> run_v2.ExecutionTemplate:
        container = run_v2.Container(
            image=self.image,
            command=list(self.command),
            args=list(self.args),
            env=[run_v2.EnvVar(name=k, value=v) for k, v in self.container_env().items()],
            resources=run_v2.ResourceRequirements(
                limits={"cpu": self.cpu, "memory": self.memory, "nvidia.com/gpu": str(self.gpu_count)}
            ),
        )
        volumes = []
        if self.checkpoint_bucket:
            volumes.append(
                run_v2.Volume(name=CHECKPOINT_VOLUME, gcs=run_v2.GCSVolumeSource(
                    bucket=self.checkpoint_bucket, mount_options=list(self.mount_options)))
            )
            container.volume_mounts = [
                run_v2.VolumeMount(name=CHECKPOINT_VOLUME, mount_path=self.checkpoint_mount_path)
            ]
        task = run_v2.TaskTemplate(
            containers=[container],
            volumes=volumes,
            max_retries=self.max_retries,
            timeout=duration_pb2.Duration(seconds=self.task_timeout),
            node_selector=run_v2.NodeSelector(accelerator=self.gpu_type),
            gpu_zonal_redundancy_disabled=not self.gpu_zonal_redundancy,
        )
        if self.service_account:
            task.service_account = self.service_account
        return run_v2.ExecutionTemplate(task_count=self.task_count, parallelism=self.parallelism, template=task)


def template_matches(existing: run_v2.Job, desired: run_v2.Job) -> bool:
    """Whether a deployed job already has the desired template and labels.

    Compares only what :class:`GpuJobSpec` controls (image, command, args, env, limits, volumes
    and mounts, retries, timeout, GPU selector, zonal redundancy, task count, parallelism,
    labels), with the server defaults filled in (``maxRetries`` 3, ``timeout`` 600 s,
    ``taskCount`` 1). An unset ``service_account`` in ``desired`` matches any deployed one,
    because Cloud Run fills in the default compute service account.

    :param existing: the job as GetJob returns it.
    :param desired: the job as :meth:`GpuJobSpec.to_job` builds it.
    :return: ``True`` when an UpdateJob would change nothing this spec controls.
    """
    have, want = _controlled_view(existing), _controlled_view(desired)
    if not want["service_account"]:
        have["service_account"] = want["service_account"]
    return have == want


def _controlled_view(job: run_v2.Job) -> dict[str, Any]:
    execution = job.template
    task = execution.template
    containers = [
        {
            "image": c.image,
            "command": list(c.command),
            "args": list(c.args),
            "env": [(e.name, e.value) for e in c.env],
            "limits": dict(c.resources.limits),
            "mounts": [(m.name, m.mount_path) for m in c.volume_mounts],
        }
        for c in task.containers
    ]
    return {
        "labels": dict(job.labels),
        "task_count": execution.task_count or 1,
        "parallelism": execution.parallelism,
        "containers": containers,
        "volumes": [(v.name, v.gcs.bucket, list(v.gcs.mount_options)) for v in task.volumes],
        "max_retries": task.max_retries if "max_retries" in task else 3,
        "timeout": task.timeout.total_seconds() if "timeout" in task else 600.0,
        "service_account": task.service_account,
        "accelerator": task.node_selector.accelerator,
        "gpu_zonal_redundancy_disabled": bool(task.gpu_zonal_redundancy_disabled),
    }
