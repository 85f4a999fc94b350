"""Typed Cloud Run GPU job specification: every validation rule, and the ``run_v2.Job`` it maps to.

Pure: no I/O, no clients. :class:`GpuJobSpec` mirrors::

    gcloud beta run jobs deploy JOB --image IMAGE --gpu 1 --gpu-type nvidia-l4 \\
        --no-gpu-zonal-redundancy --cpu 4 --memory 16Gi --task-timeout 168h --max-retries 3 \\
        --service-account SA \\
        --add-volume name=checkpoint-volume,type=cloud-storage,bucket=BUCKET \\
        --add-volume-mount volume=checkpoint-volume,mount-path=/checkpoints

Every rule on a name, quantity or limit lives in :mod:`~airflow_gpu_resilience.cloud_run_rules`
(with its source); this module applies them to one job and builds the message.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from google.api import launch_stage_pb2
from google.cloud import run_v2
from google.protobuf import duration_pb2

from airflow_gpu_resilience.cloud_run_rules import (
    GA_GPU_TASK_TIMEOUT_SECONDS,
    GPU_TYPES,
    MAX_RETRIES_RANGE,
    MAX_TASK_COUNT,
    MAX_TASK_TIMEOUT_SECONDS,
    RESERVED_ENV,
    RESERVED_LABEL_PREFIXES,
    check_range,
    env_var_problem,
    parse_cpu,
    parse_memory_gib,
    validate_bucket_name,
    validate_job_name,
)
from airflow_gpu_resilience.mount_options import parse_mount_options

__all__ = [
    "CHECKPOINT_DIR_ENV",
    "CHECKPOINT_VOLUME",
    "GA_GPU_TASK_TIMEOUT_SECONDS",
    "GPU_TYPES",
    "MAX_RETRIES_RANGE",
    "MAX_TASK_COUNT",
    "MAX_TASK_TIMEOUT_SECONDS",
    "RESERVED_ENV",
    "TASK_TIMEOUT_ENV",
    "GpuJobSpec",
    "parse_cpu",
    "parse_memory_gib",
    "template_matches",
    "validate_bucket_name",
    "validate_job_name",
]

#: Name of the Cloud Storage volume that holds checkpoints.
CHECKPOINT_VOLUME = "checkpoint-volume"
#: Environment variable that tells the worker where the checkpoint root is.
CHECKPOINT_DIR_ENV = "CHECKPOINT_DIR"
#: Environment variable that tells the worker its attempt's task timeout (seconds), so that it
#: checkpoints and exits 143 shortly before Cloud Run stops it.
TASK_TIMEOUT_ENV = "TASK_TIMEOUT_SECONDS"

_LABEL_KEY_RE = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")
_LABEL_VALUE_RE = re.compile(r"^[a-z0-9_-]{0,63}$")


@dataclass(frozen=True, kw_only=True)
class GpuJobSpec:
    """A Cloud Run job with one GPU per task (or, asked for by ``gpu_type=None``, none) and a
    Cloud Storage checkpoint volume.

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
    :param gpu_type: one of :data:`GPU_TYPES` (default ``"nvidia-l4"``), or ``None`` (an empty
        rendered template too) for a CPU-only job, for example a smoke test on Cloud Run without
        GPU quota: no GPU limit, no accelerator, no GPU minimums; a ``UserWarning`` states it.
    :param gpu_count: GPUs per instance; Cloud Run supports exactly 1 (default). A CPU-only job
        takes 1 (the default, ignored) or 0.
    :param gpu_zonal_redundancy: reserve failover capacity across zones (default ``False``, which
        sets ``gpuZonalRedundancyDisabled=true`` like ``--no-gpu-zonal-redundancy``); must stay
        ``False`` for a CPU-only job.
    :param task_timeout: per-attempt task timeout in seconds (default 3600); 1 to 604800 (168 h).
        Above 3600 s a GPU job uses the Preview launch stage (BETA).
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
    gpu_type: str | None = "nvidia-l4"
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
        check_range("max_retries", self.max_retries, *MAX_RETRIES_RANGE)
        check_range("task_count", self.task_count, 1, MAX_TASK_COUNT)
        check_range("parallelism", self.parallelism, 0, MAX_TASK_COUNT)
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
        if self.gpu_type is None:
            if self.gpu_count not in (0, 1) or isinstance(self.gpu_count, bool):
                raise ValueError(f"gpu_count={self.gpu_count!r}: a CPU-only job (gpu_type=None) takes 0 or 1 (ignored)")
            if self.gpu_zonal_redundancy is not False:
                raise ValueError("gpu_zonal_redundancy=True needs a GPU: it is invalid with gpu_type=None")
            warnings.warn("gpu_type=None: a CPU-only job, with no GPU", UserWarning, stacklevel=5)
            return
        if self.gpu_type not in GPU_TYPES:
            raise ValueError(f"gpu_type={self.gpu_type!r} is not supported; allowed: {sorted(GPU_TYPES)}")
        if self.gpu_count != 1:
            raise ValueError(f"gpu_count={self.gpu_count!r}: Cloud Run allows exactly 1 GPU per instance")
        if not isinstance(self.gpu_zonal_redundancy, bool):
            raise ValueError(f"gpu_zonal_redundancy={self.gpu_zonal_redundancy!r} must be True or False")

    def _validate_resources(self) -> None:
        min_cpu, min_gib, _ = GPU_TYPES[self.gpu_type] if self.gpu_type else (0.0, 0.0, False)
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
            problem = env_var_problem(key, value)
            if problem:
                raise ValueError(f"env[{key!r}]: {problem}")
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

        True for a Preview GPU type (RTX PRO 6000) or a GPU task timeout above 3600 s; never for
        a CPU-only job (its task timeout up to 168 h is generally available).
        """
        if self.gpu_type is None:
            return False
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

    def _limits(self) -> dict[str, str]:
        limits = {"cpu": self.cpu, "memory": self.memory}
        if self.gpu_type:
            limits["nvidia.com/gpu"] = str(self.gpu_count)
        return limits

    def _execution_template(self) -> run_v2.ExecutionTemplate:
        container = run_v2.Container(
            image=self.image,
            command=list(self.command),
            args=list(self.args),
            env=[run_v2.EnvVar(name=k, value=v) for k, v in self.container_env().items()],
            resources=run_v2.ResourceRequirements(limits=self._limits()),
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
        )
        if self.gpu_type:
            task.node_selector = run_v2.NodeSelector(accelerator=self.gpu_type)
            task.gpu_zonal_redundancy_disabled = not self.gpu_zonal_redundancy
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
