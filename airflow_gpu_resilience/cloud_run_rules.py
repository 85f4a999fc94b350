"""Cloud Run's and Cloud Storage's rules on names, quantities and limits, as pure checks.

No I/O, no clients: the job spec (:mod:`~airflow_gpu_resilience.job_spec`) and the execute
operator's override check validate with these, so that one rule has one home.

Sources of the rules:

- GPU types and minimums: https://cloud.google.com/run/docs/configuring/jobs/gpu
  (L4: at least 4 vCPU and 16 GiB; RTX PRO 6000 Blackwell, Preview: at least 20 vCPU and 80 GiB;
  exactly one GPU per instance).
- Retries: https://cloud.google.com/run/docs/configuring/max-retries (0-10, default 3, per task).
- Task timeout: https://cloud.google.com/run/docs/configuring/task-timeout (maximum 168 h; GPU
  task timeouts above 1 h are the Preview "long running GPU jobs" feature).
- Tasks per execution: https://cloud.google.com/run/docs/configuring/jobs/parallelism (1-10000).
- Job names: https://cloud.google.com/run/docs/create-jobs (lowercase letters, digits and
  dashes, starting with a letter, not ending with a dash, at most 63 characters).
- Bucket names: https://cloud.google.com/storage/docs/buckets#naming.
- Project ids: https://cloud.google.com/resource-manager/docs/creating-managing-projects (6-30
  lowercase letters, digits and hyphens, starting with a letter, not ending with a hyphen; older
  projects may be domain-scoped, ``example.com:my-project``); a project number also names one.
- Regions: https://cloud.google.com/run/docs/locations (``us-central1``, ``europe-west4``, ...).
- Environment variables: https://cloud.google.com/run/docs/configuring/jobs/environment-variables
  (a name is not empty and holds no ``=``; values are text) and the reserved names of
  https://cloud.google.com/run/docs/container-contract#jobs-env-vars.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping

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
#: A domain-scoped project id's domain: two or more dot-separated labels of lowercase letters,
#: digits and ``-`` (1-63 characters each, not starting or ending with ``-``).
_DOMAIN = r"(?:[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?\.)+[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?"
_PROJECT_ID_RE = re.compile(rf"^(?:{_DOMAIN}:)?[a-z][-a-z0-9]{{4,28}}[a-z0-9]$|^[1-9][0-9]{{0,19}}$")
_REGION_RE = re.compile(r"^[a-z]+(?:-[a-z]+)+[0-9]{1,2}$")
_BUCKET_CHARS_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*[a-z0-9]$")
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


def validate_job_name(name: str, param: str = "name") -> None:
    """Check a Cloud Run job name: lowercase letters, digits and ``-``, at most 63 characters.

    It must start with a letter and must not end with a dash (Cloud Run resource naming rules).

    :param name: the job id, not the full resource name.
    :param param: the argument's name as the caller's user wrote it (``job_name`` for an
        operator), used in the message.
    :raises ValueError: naming ``param`` and the rule that the name breaks.
    """
    if not isinstance(name, str) or not _JOB_NAME_RE.match(name):
        raise ValueError(
            f"{param}={name!r} is not a valid Cloud Run job name: use 1-63 lowercase letters, "
            "digits and '-', starting with a letter and not ending with '-'"
        )


def validate_project_id(project_id: str, param: str = "project_id") -> None:
    """Check a Google Cloud project id (or project number), as a resource name's ``projects/`` segment.

    :param project_id: the project id, e.g. ``my-project``, ``example.com:my-project`` or ``123456``.
    :param param: the argument's name as the user wrote it, used in the message.
    :raises ValueError: naming ``param`` and the rule.
    """
    if not isinstance(project_id, str) or not _PROJECT_ID_RE.fullmatch(project_id):
        raise ValueError(
            f"{param}={project_id!r} is not a Google Cloud project id: use 6-30 lowercase letters, digits and "
            "'-', starting with a letter and not ending with '-' (optionally after a domain and ':', as in "
            "'example.com:my-project'), or a project number"
        )


def validate_region(region: str, param: str = "region") -> None:
    """Check a Cloud Run region: lowercase words joined by ``-``, ending in a number (``us-central1``).

    :param region: the region, e.g. ``us-central1``.
    :param param: the argument's name as the user wrote it, used in the message.
    :raises ValueError: naming ``param`` and the rule.
    """
    if not isinstance(region, str) or not _REGION_RE.match(region):
        raise ValueError(f"{param}={region!r} is not a Cloud Run region: use one such as 'us-central1' or "
                         "'europe-west4' (lowercase words joined by '-', ending in a number)")


def validate_bucket_name(bucket: str, param: str = "checkpoint_bucket") -> None:
    """Check a Cloud Storage bucket name against the GCS naming rules.

    Rules: lowercase letters, digits, ``-``, ``_`` and ``.``; starts and ends with a letter or
    digit; 3-63 characters, or up to 222 with dots where each dot-separated part is at most 63;
    not an IPv4 address; does not start with ``goog`` and does not contain ``google`` (or the
    ``g00gle`` misspelling).

    :param bucket: the bucket name, without ``gs://``.
    :param param: the argument's name as the user wrote it, used in the message.
    :raises ValueError: naming ``param`` and the rule that the name breaks.
    """
    problem = bucket_name_problem(bucket)
    if problem:
        raise ValueError(f"{param}={bucket!r} is not a valid Cloud Storage bucket name: {problem}")


def bucket_name_problem(bucket: str) -> str | None:
    """The first GCS naming rule ``bucket`` breaks (see :func:`validate_bucket_name`), or ``None``."""
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


def env_var_problem(name: object, value: object) -> str | None:
    """The first rule an environment variable of a container breaks, or ``None``.

    A name is a non-empty string without ``=`` or NUL, not one of :data:`RESERVED_ENV`; a value
    is a string without NUL (a process environment cannot carry one).

    :param name: the variable's name.
    :param value: its value.
    :return: what is wrong, to follow the parameter's name in a message.
    """
    if not isinstance(name, str) or not name:
        return f"name {name!r} must be a non-empty string"
    if "=" in name or "\x00" in name:
        return f"name {name!r} must not contain '=' or NUL"
    if name in RESERVED_ENV:
        return f"name {name!r} is reserved by Cloud Run: {sorted(RESERVED_ENV)}"
    if not isinstance(value, str):
        return f"value {value!r} of {name!r} must be a string"
    if "\x00" in value:
        return f"value of {name!r} must not contain NUL"
    return None


def check_range(param: str, value: int, low: int, high: int) -> None:
    """Check an integer argument against an inclusive range (``bool`` is not an integer here).

    :param param: the argument's name as the user wrote it.
    :param value: the value to check.
    :param low: smallest allowed value.
    :param high: largest allowed value.
    :raises ValueError: naming ``param`` and the range.
    """
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{param}={value!r} is out of range: allowed integers are {low}-{high}")
