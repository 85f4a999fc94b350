"""Job validation as Cloud Run does it, raising ``InvalidArgument`` that names the field.

Rules (Cloud Run's documented ones; which features need a preview launch stage is inferred
from its documentation, not confirmed):

- job id: lowercase letters, digits and hyphens, starts with a letter, no trailing hyphen,
  at most 63 characters;
- at least one container, each with an image; ``taskCount`` >= 1 (0 means the default 1);
  ``parallelism`` >= 0; ``maxRetries`` 0-10; task timeout > 0 and <= 168 h;
- ``resources.limits`` keys only ``cpu``, ``memory``, ``nvidia.com/gpu``; a GPU is exactly
  ``"1"`` on one container, needs ``nodeSelector.accelerator`` of a known type and that type's
  minimum CPU and memory (nvidia-l4: 4 vCPU, 16 GiB; nvidia-rtx-pro-6000: 20 vCPU, 80 GiB);
- launch stage ALPHA or BETA is required for the nvidia-rtx-pro-6000 GPU and for a GPU task
  timeout over 1 h (a task without a GPU may run up to 168 h generally available: the task
  timeout page's current maximum, where older pages put everything over 24 h in Preview);
- project ids (6-30 lowercase letters, digits, hyphens, optionally domain-scoped as in
  ``example.com:my-project``; or a project number) and regions in names; bucket names by Cloud Storage's rules (checked before the GCS emulator sees them);
- every GCS volume's bucket exists and its ``mountOptions`` are gcsfuse flags the emulator knows
  (see :data:`cloud_run_emulator.mount_options.GCSFUSE_MOUNT_OPTIONS`); every volume mount names a declared volume; a
  ``mountPath`` is absolute, without ``:`` or ``..``, not ``/``; a ``subPath`` is relative,
  without ``..``; an env value, arg, command element or ``workingDir`` under a GCS mount path does not lead out
  of the volume (``/checkpoints/../x``), as the emulator rewrites those to the bucket's folder;
- labels/annotations in reserved namespaces (``run.googleapis.com`` etc.) are rejected;
- environment variables (in the template and in RunJob's ``containerOverrides``): at most 1000
  per container (Cloud Run's documented maximum); a name is required, at most 32768 characters
  (the ``EnvVar`` proto), not one of the ``CLOUD_RUN_*`` names Cloud Run sets in each task (its
  container runtime contract reserves them), without ``=`` or NUL; a value at most 32768 bytes
  (the proto) without NUL. ``NAME=VALUE`` strings ending in NUL are what a process receives, so
  such a variable cannot be passed on at all; Cloud Run's own message for it is unconfirmed. The
  same holds for NUL in ``command`` and ``args`` elements (inferred: they are ``execve`` strings);
- RunJob's ``taskCount`` override: 0 (not set) or 1 to 10,000, Cloud Run's limit of tasks per
  execution, as in the job (:func:`validate_overrides`).

Not validated: CPU/memory values beyond the GPU minimums, ports, probes, service accounts.
"""

from __future__ import annotations

import re

from google.api import launch_stage_pb2
from google.cloud import run_v2

from .exceptions import InvalidArgument
from .mount_options import parse_mount_options
from .guards import climbs_out, under_mount

JOB_ID = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
GPU_KEY = "nvidia.com/gpu"
GPU_TYPES = {"nvidia-l4": (4.0, 16.0, False), "nvidia-rtx-pro-6000": (20.0, 80.0, True)}
PREVIEW = {launch_stage_pb2.ALPHA, launch_stage_pb2.BETA}
GA = launch_stage_pb2.GA
MAX_TIMEOUT_S = 168 * 3600
RESERVED = ("run.googleapis.com", "cloud.googleapis.com", "serving.knative.dev", "autoscaling.knative.dev")
_MEM_UNITS = {"": 1 / 2**30, "k": 1e3 / 2**30, "K": 1e3 / 2**30, "M": 1e6 / 2**30, "G": 1e9 / 2**30, "T": 1e12 / 2**30,
              "Ki": 1 / 2**20, "Mi": 1 / 2**10, "Gi": 1.0, "Ti": 2.0**10}

TT = "job.template.template"


#: A domain name as a domain-scoped project id's prefix: two or more dot-separated labels of
#: lowercase letters, digits and hyphens, each 1-63 characters, not starting or ending with a hyphen.
_DOMAIN = r"(?:[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?\.)+[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?"
#: A project id (6-30 lowercase letters, digits or hyphens, starting with a letter, not ending
#: with a hyphen), optionally domain-scoped (``example.com:my-project``, as older Google Workspace
#: projects are; Cloud Run's names carry it as it is), or a project number.
PROJECT_ID = re.compile(rf"^(?:(?:{_DOMAIN}:)?[a-z][-a-z0-9]{{4,28}}[a-z0-9]|[1-9][0-9]{{0,19}})$")
#: A Cloud Run region: lowercase words joined by hyphens, ending in a number (``us-central1``).
LOCATION = re.compile(r"^[a-z]+(?:-[a-z]+)+[0-9]{1,2}$")


def validate_project_location(project: str, location: str, field: str) -> None:
    """Reject a project id or location that Cloud Run would reject (``..`` included).

    :param project: the ``projects/{project}`` segment of a name.
    :param location: the ``locations/{location}`` segment.
    :param field: the request field the name came in (``name``, ``parent``, ...), for the message.
    :raises InvalidArgument: naming ``field`` and the rule broken.
    """
    if not PROJECT_ID.fullmatch(project):
        raise InvalidArgument(
            f"{field}: project '{project}' is not a project id (6 to 30 lowercase letters, digits or "
            "hyphens, starting with a letter and not ending with a hyphen, optionally after 'domain:') "
            "or a project number.")
    if not LOCATION.match(location):
        raise InvalidArgument(f"{field}: location '{location}' is not a Cloud Run region such as 'us-central1'.")


_BUCKET = re.compile(r"^[a-z0-9][-_.a-z0-9]*[a-z0-9]$")
_DOTTED_QUAD = re.compile(r"^[0-9]{1,3}(?:\.[0-9]{1,3}){3}$")
_GOOGLE = re.compile(r"g[o0][o0]g[l1]e")


def validate_bucket_name(name, field: str = "name") -> None:
    """Reject a bucket name that Cloud Storage would reject: 3-63 characters (222 with dots,
    63 between dots), lowercase letters, digits, ``-``, ``_`` and ``.``, starting and ending with
    a letter or digit; not an IP address; not starting with ``goog``; no ``google`` (or
    ``g00gle`` and the like).

    :param name: the proposed bucket name (any JSON value).
    :param field: the request field, for the message.
    :raises InvalidArgument: naming ``field`` and the rule broken.
    """
    rules = ("Bucket names must be 3-63 characters (222 with dots, 63 between dots) of lowercase letters, "
             "digits, '-', '_' and '.', start and end with a letter or digit, not be an IP address, not "
             "start with 'goog' and not contain 'google'.")
    if not isinstance(name, str):
        raise InvalidArgument(f"{field}: a bucket name must be a string, got {name!r}. {rules}")
    parts = name.split(".")
    if (not _BUCKET.match(name) or len(name) < 3 or len(name) > (222 if len(parts) > 1 else 63)
            or any(not part or len(part) > 63 for part in parts) or _DOTTED_QUAD.match(name)
            or name.startswith("goog") or _GOOGLE.search(name)):
        raise InvalidArgument(f"{field}: invalid bucket name '{name}'. {rules}")


def validate_job_id(job_id: str) -> None:
    """Reject a job id that Cloud Run would reject."""
    if not JOB_ID.match(job_id or ""):
        raise InvalidArgument(
            f"job_id: '{job_id}' must use only lowercase letters, digits and hyphens, start with a "
            "letter, not end with a hyphen, and be at most 63 characters.")


def parse_cpu(value: str, field: str) -> float:
    """A CPU quantity in vCPUs: a decimal number of vCPUs, or of thousandths with ``m``."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(m?)", value)
    if not match:
        raise InvalidArgument(f"{field}: invalid CPU quantity '{value}'.")
    return float(match.group(1)) / (1000 if match.group(2) else 1)


def parse_memory_gib(value: str, field: str) -> float:
    """A Kubernetes memory quantity in GiB."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]i?|k)?", value)
    if not match or (match.group(2) or "") not in _MEM_UNITS:
        raise InvalidArgument(f"{field}: invalid memory quantity '{value}'.")
    return float(match.group(1)) * _MEM_UNITS[match.group(2) or ""]


def timeout_seconds(template: run_v2.TaskTemplate) -> float:
    """The per-attempt timeout in seconds (600 when unset)."""
    return template.timeout.total_seconds() if "timeout" in template else 600.0


#: Cloud Run's limit on tasks per execution (the ``--tasks`` range is 1 to 10,000).
MAX_TASK_COUNT = 10_000
#: The variables Cloud Run sets in every task (its container runtime contract); a job may not set them.
RESERVED_ENV = ("CLOUD_RUN_JOB", "CLOUD_RUN_EXECUTION", "CLOUD_RUN_TASK_INDEX", "CLOUD_RUN_TASK_ATTEMPT",
                "CLOUD_RUN_TASK_COUNT")
#: Environment variables per container (Cloud Run's documented maximum).
MAX_ENV_VARS = 1000
#: Longest environment variable name (characters) and value (UTF-8 bytes), from the ``EnvVar`` proto.
MAX_ENV_NAME, MAX_ENV_VALUE_BYTES = 32768, 32768


def validate_env(env, field: str) -> None:
    """Refuse environment variables Cloud Run refuses, or that no process could receive.

    :param env: the ``EnvVar`` messages of one container (or of one container override).
    :param field: their path in error messages, e.g. ``job.template.template.containers[0].env``.
    :raises InvalidArgument: naming the variable's field (``...env[2].name``), the rule and the
        allowed values (see the module docstring for the rules and their sources).
    """
    if len(env) > MAX_ENV_VARS:
        raise InvalidArgument(f"{field}: {len(env)} variables; at most {MAX_ENV_VARS} are allowed per container.")
    for i, var in enumerate(env):
        name, where = var.name, f"{field}[{i}]"
        if not name or "=" in name or "\0" in name or len(name) > MAX_ENV_NAME:
            raise InvalidArgument(
                f"{where}.name: {name!r} is not a valid environment variable name: it must be 1 to "
                f"{MAX_ENV_NAME} characters without '=' or NUL.")
        if name in RESERVED_ENV:
            raise InvalidArgument(
                f"{where}.name: {name!r} is reserved: Cloud Run sets {', '.join(RESERVED_ENV)} in every task.")
        value = var.value if "value" in var else ""
        if "\0" in value or len(value.encode("utf-8", "surrogatepass")) > MAX_ENV_VALUE_BYTES:
            raise InvalidArgument(
                f"{where}.value: the value of {name!r} must be at most {MAX_ENV_VALUE_BYTES} bytes without NUL.")


def validate_argv(container, field: str) -> None:
    """Refuse a ``command`` or ``args`` element holding NUL (no process can be given it).

    :param container: a ``Container`` or a container override (``args`` only).
    :param field: its path in error messages.
    :raises InvalidArgument: naming the element, e.g. ``...containers[0].args[1]``.
    """
    for kind in ("command", "args"):
        for i, part in enumerate(getattr(container, kind, ())):
            if "\0" in part:
                raise InvalidArgument(f"{field}.{kind}[{i}]: {part!r} contains NUL, which no process can be given.")


def validate_overrides(overrides: run_v2.RunJobRequest.Overrides) -> None:
    """Check RunJob's overrides on their own, before they are applied to the job's template
    (which is then checked whole by :func:`validate_task_template`).

    :param overrides: the request's overrides.
    :raises InvalidArgument: naming the field as the request spells it
        (``overrides.container_overrides[0].env[1].name``, ``overrides.task_count``).
    """
    for i, override in enumerate(overrides.container_overrides):
        field = f"overrides.container_overrides[{i}]"
        validate_env(override.env, f"{field}.env")
        validate_argv(override, field)
    if not 0 <= overrides.task_count <= MAX_TASK_COUNT:
        raise InvalidArgument(
            f"overrides.task_count: must be between 1 and {MAX_TASK_COUNT} (Cloud Run's limit of tasks per "
            f"execution; 0 or unset keeps the job's), got {overrides.task_count}.")


def check_enum_values(message, prefix: str) -> None:
    """Refuse enum fields holding a number their enum does not define: JSON may carry any
    integer for an (open) proto3 enum, and Google answers such a value with INVALID_ARGUMENT
    ("Invalid value at ...").

    :param message: a raw protobuf message (``run_v2.Job.pb(job)``).
    :param prefix: the field path of ``message`` in error messages (``job``).
    :raises InvalidArgument: naming the field, the value and the allowed names.
    """
    for field, value in message.ListFields():
        path = f"{prefix}.{field.name}"
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            entry = field.message_type.fields_by_name["value"]
            if entry.message_type is not None:
                for key, item in value.items():
                    check_enum_values(item, f"{path}[{key!r}]")
            continue
        items = list(value) if field.is_repeated else [value]
        for i, item in enumerate(items):
            where = f"{path}[{i}]" if field.is_repeated else path
            if field.enum_type is not None and item not in field.enum_type.values_by_number:
                allowed = ", ".join(v.name for v in field.enum_type.values)
                raise InvalidArgument(f"{where}: invalid value {item}; allowed: {allowed}.")
            if field.message_type is not None:
                check_enum_values(item, where)


def validate_job(job: run_v2.Job, bucket_exists) -> int:
    """Validate a job spec; return the launch stage to report (BETA when preview features are
    used, else GA).

    :param job: the job as sent (defaults not yet filled).
    :param bucket_exists: ``callable(bucket) -> bool``.
    """
    check_enum_values(run_v2.Job.pb(job), "job")
    _validate_meta(job.labels, job.annotations, "job")
    _validate_meta(job.template.labels, job.template.annotations, "job.template")
    if not 0 <= job.template.task_count <= MAX_TASK_COUNT:
        raise InvalidArgument(f"job.template.task_count: must be between 1 and {MAX_TASK_COUNT}.")
    if job.template.parallelism < 0:
        raise InvalidArgument("job.template.parallelism: must be >= 0.")
    preview = validate_task_template(job.template.template, bucket_exists)
    if preview and job.launch_stage not in PREVIEW:
        raise InvalidArgument(
            f"job.launch_stage: {preview} is a Preview feature; set launch_stage to ALPHA or BETA.")
    return launch_stage_pb2.BETA if preview else GA


def _validate_meta(labels, annotations, field: str) -> None:
    for kind, mapping in (("labels", labels), ("annotations", annotations)):
        for key in mapping:
            if key.split("/", 1)[0] in RESERVED:
                raise InvalidArgument(f"{field}.{kind}: the key '{key}' uses a reserved namespace.")


def validate_task_template(template: run_v2.TaskTemplate, bucket_exists) -> str:
    """Validate a TaskTemplate; return the name of a preview feature it uses, or ``""``."""
    if not template.containers:
        raise InvalidArgument(f"{TT}.containers: at least one container is required.")
    if "max_retries" in template and not 0 <= template.max_retries <= 10:
        raise InvalidArgument(f"{TT}.max_retries: must be between 0 and 10, got {template.max_retries}.")
    timeout = timeout_seconds(template)
    if not 0 < timeout <= MAX_TIMEOUT_S:
        raise InvalidArgument(f"{TT}.timeout: must be greater than 0 and at most 168 hours, got {timeout:g}s.")
    _validate_volumes(template, bucket_exists)
    gpu_type = _validate_containers(template)
    if gpu_type and GPU_TYPES[gpu_type][2]:
        return f"The GPU type {gpu_type}"
    if gpu_type and timeout > 3600:
        return "A GPU task timeout over 1 hour"
    return ""


def _validate_volumes(template: run_v2.TaskTemplate, bucket_exists) -> None:
    names, gcs_names = set(), set()
    for i, volume in enumerate(template.volumes):
        if not volume.name:
            raise InvalidArgument(f"{TT}.volumes[{i}].name: a volume name is required.")
        names.add(volume.name)
        if "gcs" in volume:
            gcs_names.add(volume.name)
            if not bucket_exists(volume.gcs.bucket):
                raise InvalidArgument(
                    f"{TT}.volumes[{i}].gcs.bucket: bucket '{volume.gcs.bucket}' does not exist.")
            try:
                parse_mount_options(list(volume.gcs.mount_options), f"{TT}.volumes[{i}].gcs.mount_options",
                                    emulator=True)
            except ValueError as exc:
                raise InvalidArgument(str(exc)) from None
    sql = {v.name for v in template.volumes if "cloud_sql_instance" in v}
    for c, container in enumerate(template.containers):
        mounted = []
        for m, mount in enumerate(container.volume_mounts):
            field = f"{TT}.containers[{c}].volume_mounts[{m}]"
            if mount.name not in names:
                raise InvalidArgument(f"{field}.name: no volume named '{mount.name}'.")
            _validate_mount_paths(mount, field, mount.name in sql)
            if mount.name in gcs_names:
                mounted.append(mount.mount_path.rstrip("/"))
        _validate_paths_in_volumes(container, f"{TT}.containers[{c}]", mounted)


def _validate_mount_paths(mount: run_v2.VolumeMount, field: str, cloud_sql: bool) -> None:
    """``mountPath``: absolute, no ``:``, no ``..``, not ``/`` (empty only for Cloud SQL);
    ``subPath``: relative, no ``..`` (it must stay inside the volume)."""
    path = mount.mount_path
    if not path and not cloud_sql:
        raise InvalidArgument(f"{field}.mount_path: a mount path is required.")
    if path and (not path.startswith("/") or ":" in path or ".." in path.split("/") or not path.strip("/")):
        raise InvalidArgument(
            f"{field}.mount_path: '{path}' must be an absolute path other than '/', without ':' or '..'.")
    sub = mount.sub_path
    if sub and (sub.startswith("/") or ".." in sub.split("/")):
        raise InvalidArgument(f"{field}.sub_path: '{sub}' must be a relative path inside the volume, without '..'.")


def _validate_paths_in_volumes(container: run_v2.Container, field: str, mount_paths: list) -> None:
    """Env values, args and command elements under a GCS mount path (the emulator rewrites them
    to the bucket's folder) must not lead out of the volume (``/checkpoints/../x``)."""
    if not mount_paths:
        return
    values = [(f"{field}.env[{i}].value", var.value) for i, var in enumerate(container.env)]
    values += [(f"{field}.args[{i}]", arg) for i, arg in enumerate(container.args)]
    values += [(f"{field}.command[{i}]", part) for i, part in enumerate(container.command)]
    values += [(f"{field}.working_dir", container.working_dir)] if container.working_dir else []
    for where, value in values:
        for mount_path in mount_paths:
            split = under_mount(value, mount_path)
            if split is not None and climbs_out(split[1]):
                raise InvalidArgument(f"{where}: '{value}' leads out of the volume mounted at {mount_path}.")


def _validate_containers(template: run_v2.TaskTemplate) -> str:
    """Check images and limits; return the GPU type in use, or ``""``."""
    gpu_containers = []
    for c, container in enumerate(template.containers):
        field = f"{TT}.containers[{c}]"
        if not container.image:
            raise InvalidArgument(f"{field}.image: an image is required.")
        validate_env(container.env, f"{field}.env")
        validate_argv(container, field)
        limits = dict(container.resources.limits)
        for key in limits:
            if key not in ("cpu", "memory", GPU_KEY):
                raise InvalidArgument(f"{field}.resources.limits: unsupported resource '{key}'.")
        if GPU_KEY in limits:
            if limits[GPU_KEY] != "1":
                raise InvalidArgument(f"{field}.resources.limits: '{GPU_KEY}' must be \"1\", got '{limits[GPU_KEY]}'.")
            gpu_containers.append((field, limits))
    if len(gpu_containers) > 1:
        raise InvalidArgument(f"{TT}.containers: a GPU can be attached to only one container.")
    accelerator = template.node_selector.accelerator
    if not gpu_containers:
        if accelerator:
            raise InvalidArgument(f"{TT}.node_selector.accelerator: set, but no container requests '{GPU_KEY}'.")
        return ""
    if accelerator not in GPU_TYPES:
        raise InvalidArgument(
            f"{TT}.node_selector.accelerator: unknown GPU type '{accelerator}'; "
            f"supported: {', '.join(sorted(GPU_TYPES))}.")
    _validate_gpu_minimums(*gpu_containers[0], accelerator)
    return accelerator


def _validate_gpu_minimums(field: str, limits: dict, accelerator: str) -> None:
    min_cpu, min_mem, _ = GPU_TYPES[accelerator]
    cpu = parse_cpu(limits.get("cpu", "1"), f"{field}.resources.limits.cpu")
    if cpu < min_cpu:
        raise InvalidArgument(f"{field}.resources.limits.cpu: {accelerator} needs at least {min_cpu:g} CPU, got {cpu:g}.")
    mem = parse_memory_gib(limits.get("memory", "512Mi"), f"{field}.resources.limits.memory")
    if mem + 1e-9 < min_mem:
        raise InvalidArgument(
            f"{field}.resources.limits.memory: {accelerator} needs at least {min_mem:g}Gi, got {mem:g}Gi.")
