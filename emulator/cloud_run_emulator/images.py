"""The image table: how a container image maps to a local command (there is no Docker here).

File format (JSON), given to ``serve --images FILE`` (repeat ``--images`` to combine tables,
e.g. the bundled worker's and a user image's)::

    {"images": {
        "local/exit:latest": {"entrypoint": ["{python}", "-c", "import os,sys; sys.exit(int(os.environ.get('CODE','0')))"]},
        "us-docker.pkg.dev/*/trainer:*": {
            "entrypoint": ["{python}", "-m", "gpu_resilience_trainer"], "cmd": ["train"],
            "cwd": ".", "env": {"PYTHONPATH": "."}
        }
    }}

- Keys are an exact image reference or an ``fnmatch`` pattern; an exact match wins, then the
  first matching pattern in file order.
- ``entrypoint`` and ``cmd`` play Docker's ENTRYPOINT and CMD. Kubernetes/Cloud Run semantics
  apply: the container's ``command`` replaces the entrypoint, its ``args`` replace ``cmd``, and a
  ``command`` given without ``args`` drops ``cmd``.
- ``{python}`` in any string becomes the emulator's ``sys.executable``; ``{table_dir}`` becomes
  the table file's directory. (Plain substitution, so other braces in ``-c`` scripts are safe.)
- ``cwd`` (default ``"."``) and each relative ``PYTHONPATH`` entry resolve against the table
  file's directory. ``env`` is applied under the container's own env.
- ``workdir`` (optional): the image's own working directory (its Dockerfile's ``WORKDIR``, e.g.
  ``"/src"``), which ``cwd`` plays here: a container ``workingDir`` at or below it runs in
  ``cwd`` or that folder of it (see :func:`~.runtime.working_dir` for the other cases).
- Several files: each file's relative paths resolve against its own directory; an exact match
  in any file wins, then the first matching pattern in file order (earlier files first); for a
  key in two files, the earlier file's entry is used.
- Entries are also added at run time: an image the Cloud Build emulator built and pushed to the
  Artifact Registry emulator (see :mod:`.artifact_registry`), under its exact references, until
  it is deleted there.
- An image with no entry is accepted at CreateJob (deploy-only tests keep working); at run time
  its task fails at once, without retries, with a message naming the image.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import sys
from pathlib import Path
from typing import Optional, Sequence, Union


@dataclasses.dataclass(frozen=True)
class ImageEntry:
    """One resolved image: argv parts, working directory (and the container path it plays,
    ``""`` when not given) and environment."""

    entrypoint: tuple
    cmd: tuple
    cwd: Path
    env: dict
    workdir: str = ""

    def argv(self, command: list, args: list) -> list:
        """The process argv for a container ``command``/``args`` (Kubernetes override rules)."""
        if command:
            return list(command) + list(args)
        return list(self.entrypoint) + (list(args) if args else list(self.cmd))


class ImageTable:
    """Image reference -> :class:`ImageEntry`.

    :param entries: the ``images`` mapping of the table file.
    :param base_dir: directory that relative paths resolve against.
    """

    def __init__(self, entries: dict, base_dir: Path) -> None:
        self._base = Path(base_dir).resolve()
        self._entries = {key: self._entry(spec) for key, spec in entries.items()}

    @classmethod
    def load(cls, path: Union[None, os.PathLike, str, Sequence[Union[os.PathLike, str]]]) -> "ImageTable":
        """Read a table file, or combine several (see the module docs); ``None`` or an empty
        list gives an empty table.

        :param path: one file, a list of files, or ``None``.
        """
        if path is None:
            return cls({}, Path.cwd())
        if isinstance(path, (list, tuple)):
            combined = cls({}, Path.cwd())
            for table in (cls.load(item) for item in path):
                for key, entry in table._entries.items():
                    combined._entries.setdefault(key, entry)
            return combined
        path = Path(path)
        return cls(json.loads(path.read_text())["images"], path.parent)

    def _sub(self, value: str) -> str:
        return value.replace("{python}", sys.executable).replace("{table_dir}", str(self._base))

    def _entry(self, spec: dict) -> ImageEntry:
        env = {k: self._sub(str(v)) for k, v in spec.get("env", {}).items()}
        if "PYTHONPATH" in env:
            env["PYTHONPATH"] = os.pathsep.join(
                str((self._base / p).resolve()) for p in env["PYTHONPATH"].split(os.pathsep) if p)
        return ImageEntry(
            entrypoint=tuple(self._sub(s) for s in spec.get("entrypoint", [])),
            cmd=tuple(self._sub(s) for s in spec.get("cmd", [])),
            cwd=(self._base / self._sub(spec.get("cwd", "."))).resolve(),
            env=env,
            workdir=str(spec.get("workdir", "")),
        )

    def add(self, reference: str, entry: ImageEntry) -> None:
        """Map the exact image ``reference`` to ``entry`` (replacing an entry of that key).

        :param reference: an image reference, e.g. ``us-docker.pkg.dev/p/r/trainer@sha256:...``.
        :param entry: what a container of that image runs.
        """
        self._entries[reference] = entry

    def remove(self, reference: str) -> None:
        """Forget the entry of the exact key ``reference``, if any."""
        self._entries.pop(reference, None)

    def resolve(self, image: str) -> Optional[ImageEntry]:
        """The entry for ``image``, or ``None`` when nothing matches."""
        if image in self._entries:
            return self._entries[image]
        for pattern, entry in list(self._entries.items()):
            if fnmatch.fnmatchcase(image, pattern):
                return entry
        return None
