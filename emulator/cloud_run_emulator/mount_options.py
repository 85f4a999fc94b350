"""Cloud Storage FUSE mount options of a ``cloud-storage`` volume: which ones, and their values.

Pure functions, no I/O. The emulator is an oracle of Cloud Run's and gcsfuse's rules of its own:
its request validation and its FUSE mounts validate through :func:`parse_mount_options` here, and
the provider keeps its own table for the job spec (the distributions share no code). The
repository's tests run one table of options through both and require the same verdicts.

An option is a gcsfuse flag without the leading ``--`` (Cloud Run's ``mountOptions``), ``name`` or
``name=value``. The value rules follow gcsfuse's own flag checks (its ``cfg`` validation and the
``gcsfuse`` CLI options page): booleans as Go's ``strconv.ParseBool`` reads them (``true``,
``false``, ``1``, ``0``, ``t``, ``f``, ``TRUE``, ...); integers in ASCII decimal digits without
leading zeros (gcsfuse's flag parser would read ``010`` as octal 8); ``-1`` means "unlimited" for
the caches, their TTLs and ``write-global-max-blocks``; the TTLs at most 9223372036 s and the stat
cache at most 17592186044415 MiB (what fits gcsfuse's int64 nanoseconds and bytes); file and
folder modes in octal up to ``7777``; ``uid``/``gid`` -1 (the mounting user, gcsfuse's default)
or up to 4294967294; ``log-severity`` one of gcsfuse's levels; ``only-dir`` a relative folder of
the bucket (no commas, white space or control characters: the flags may be joined into one
``-o`` string; at most 1024 bytes, Cloud Storage's object name limit). Each option may be given once (gcsfuse keeps the
last of repeated flags; Cloud Run passes them in order, so a repeat is almost always a mistake).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

#: gcsfuse flags a Cloud Run ``cloud-storage`` volume may carry, name -> kind of value:
#: ``bool`` (bare, or one of :data:`BOOL_VALUES`), ``int`` (>= 0), ``limit`` (>= 0, or -1 for
#: unlimited), ``id`` (a uid/gid: -1 or 0-4294967294), ``mode`` (octal, 0-7777), ``severity``
#: (:data:`LOG_SEVERITIES`), ``dir`` (a relative folder of the bucket).
GCSFUSE_MOUNT_OPTIONS = {
    "implicit-dirs": "bool", "only-dir": "dir", "file-mode": "mode", "dir-mode": "mode",
    "uid": "id", "gid": "id", "rename-dir-limit": "int", "enable-streaming-writes": "bool",
    "write-global-max-blocks": "limit", "metadata-cache-ttl-secs": "limit", "stat-cache-max-size-mb": "limit",
    "type-cache-max-size-mb": "limit", "kernel-list-cache-ttl-secs": "limit", "max-conns-per-host": "int",
    "log-severity": "severity",
}
#: Options only the emulator accepts (Cloud Run refuses them): ``x-emulator-strict`` turns a
#: staged-write fallback on that volume into ``EIO``.
EMULATOR_MOUNT_OPTIONS = {"x-emulator-strict": "bool"}
#: Values of a boolean flag (Go's ``strconv.ParseBool``, which gcsfuse's flags use) -> value.
BOOL_VALUES = {**dict.fromkeys(("1", "t", "T", "TRUE", "true", "True"), True),
               **dict.fromkeys(("0", "f", "F", "FALSE", "false", "False"), False)}
#: Largest values gcsfuse accepts where it is below int64: TTLs in seconds (int64 nanoseconds)
#: and the stat cache in MiB (int64 bytes).
MAX_VALUES = {"metadata-cache-ttl-secs": 9223372036, "kernel-list-cache-ttl-secs": 9223372036,
              "stat-cache-max-size-mb": 17592186044415}
#: gcsfuse's ``--log-severity`` levels (any letter case).
LOG_SEVERITIES = ("trace", "debug", "info", "warning", "error", "off")
#: The largest uid/gid (2**32 - 2; 2**32 - 1 is "no id" to the kernel).
MAX_ID = 4294967294
#: The largest other integer (gcsfuse parses them as int64).
MAX_INT = 2**63 - 1
#: Cloud Storage's limit on an object name, in UTF-8 bytes (an ``only-dir`` folder is a prefix).
MAX_OBJECT_NAME_BYTES = 1024

_DIGITS = re.compile(r"0|[1-9][0-9]*")
_OCTAL = re.compile(r"[0-7]+")
_EXAMPLES = {"bool": "=true", "int": "=100", "limit": "=100", "id": "=1000", "mode": "=644",
             "severity": "=warning", "dir": "=checkpoints"}


def _value_problem(name: str, kind: str, has_value: bool, value: str) -> str | None:
    """Why ``value`` is not a valid value of option ``name`` of ``kind``, or ``None``."""
    if kind == "bool":
        return None if not has_value or value in BOOL_VALUES else "takes no value, or =true / =false"
    if not has_value or not value:
        return f"needs a value, e.g. {name}{_EXAMPLES[kind]}"
    if kind in ("int", "limit", "id"):
        if kind in ("limit", "id") and value == "-1":
            return None
        low = {"limit": "-1 (unlimited) or a non-negative integer", "id": "-1 (the mounting user) or a "
               "non-negative integer"}.get(kind, "a non-negative integer")
        high = MAX_ID if kind == "id" else MAX_VALUES.get(name, MAX_INT)
        if not _DIGITS.fullmatch(value) or int(value) > high:
            return (f"needs {low} in decimal digits without leading zeros, at most {high}, "
                    f"e.g. {name}{_EXAMPLES[kind]}")
        return None
    if kind == "mode":
        if not _OCTAL.fullmatch(value) or int(value, 8) > 0o7777:
            return f"needs an octal file mode from 0 to 7777, e.g. {name}{_EXAMPLES[kind]}"
        return None
    if kind == "severity":
        return None if value.lower() in LOG_SEVERITIES else f"needs one of {', '.join(LOG_SEVERITIES)}"
    # dir
    parts = value.strip("/").split("/")
    if value.startswith("/") or any(p in ("", ".", "..") for p in parts):
        return f"needs a folder of the bucket relative to its root, without '.', '..' or '//', e.g. {name}=checkpoints"
    if "," in value or any(c.isspace() or not c.isprintable() for c in value):
        # a comma separates options where the flags are joined into one -o string
        return f"needs a folder name without commas, white space or control characters, e.g. {name}=checkpoints"
    if len(value.encode()) > MAX_OBJECT_NAME_BYTES:
        return f"needs a folder name of at most {MAX_OBJECT_NAME_BYTES} bytes (Cloud Storage's object name limit)"
    return None


def _convert(kind: str, has_value: bool, value: str) -> Any:
    if kind == "bool":
        return BOOL_VALUES[value] if has_value else True
    if kind in ("int", "limit", "id"):
        return int(value)
    if kind == "mode":
        return int(value, 8)
    if kind == "severity":
        return value.lower()
    return value.strip("/")


def parse_mount_options(options: Iterable[Any], field: str = "mount_options", emulator: bool = False) -> dict:
    """Validate gcsfuse mount options and return their values.

    :param options: iterable of strings, ``name`` or ``name=value`` without the leading ``--``
        (:data:`GCSFUSE_MOUNT_OPTIONS`); ``None`` is no options.
    :param field: the parameter or request field named in errors, e.g. ``mount_options`` or
        ``template.template.volumes[0].gcs.mount_options``.
    :param emulator: also accept :data:`EMULATOR_MOUNT_OPTIONS`, as the emulator's request
        validation and its mounts do (default ``False``: Cloud Run's options alone, which refuse
        them as unknown).
    :returns: ``{name: value}``: ``bool`` for booleans, ``int`` for integers and modes (-1 for
        unlimited), lower-case ``str`` for ``log-severity``, ``only-dir`` without outer slashes.
    :raises ValueError: one message naming ``field[i]``, the option and what is allowed: a value
        that is not a string, a leading ``-``, an unknown name (with the allowed names), a bad
        value (with the allowed values), or an option given twice.
    """
    if isinstance(options, (str, bytes, Mapping)):
        raise ValueError(f"{field}={options!r} must be a list of strings, name or name=value, "
                         "e.g. ['implicit-dirs', 'rename-dir-limit=100'].")
    allowed = dict(GCSFUSE_MOUNT_OPTIONS, **(EMULATOR_MOUNT_OPTIONS if emulator else {}))
    parsed: dict = {}
    first: dict = {}
    for i, raw in enumerate(options or ()):
        where = f"{field}[{i}]"
        if not isinstance(raw, str):
            raise ValueError(f"{where}: {raw!r} must be a string, name or name=value, e.g. 'rename-dir-limit=100'.")
        name, has_value, value = raw.partition("=")
        if name.startswith("-"):
            raise ValueError(f"{where}: '{raw}' must be written without the leading '--'.")
        kind = allowed.get(name)
        if kind is None:
            raise ValueError(f"{where}: '{raw}' is not a Cloud Storage FUSE option Cloud Run accepts; "
                             f"allowed: {', '.join(sorted(allowed))}.")
        problem = _value_problem(name, kind, bool(has_value), value)
        if problem:
            raise ValueError(f"{where}: '{raw}': {name} {problem}.")
        if name in first:
            raise ValueError(f"{where}: '{raw}' repeats {name} (already {field}[{first[name]}]); give each option once.")
        first[name] = i
        parsed[name] = _convert(kind, bool(has_value), value)
    return parsed


def mount_key(parsed: dict) -> tuple:
    """A hashable key of parsed options: two option lists with the same meaning (order, ``name``
    against ``name=true``, ``log-severity`` letter case) give the same key."""
    return tuple(sorted((name, str(value)) for name, value in parsed.items()))
