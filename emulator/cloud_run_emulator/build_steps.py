"""The pieces of an emulated Cloud Build that need no API state: reading a source archive, the
``docker`` builder's arguments, an image's digest, and the image table entry of a built image.

Used by :mod:`.cloud_build`; pure functions but for :func:`unpack` and :func:`context_digest`,
which read and write the folders they are given.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import posixpath
import re
import sys
import tarfile
from pathlib import Path
from typing import Optional

from .dockerfile import ImageConfig
from .images import ImageEntry

#: The builder image of Docker steps (``docker build``, ``docker push``), with or without a tag.
DOCKER_BUILDER = re.compile(r"^(?:gcr\.io/cloud-builders/docker|docker)(?::[\w.-]+)?$")
#: ``docker build`` options that take a value (``-t X`` or ``--tag=X``); others are flags.
_VALUE_OPTIONS = frozenset({"-t", "--tag", "-f", "--file", "--build-arg", "--network", "--platform", "--target",
                            "--cache-from", "--label", "--secret", "--progress", "--iidfile", "--add-host"})
#: An interpreter name in an image's argv that the emulator's own Python stands in for.
_PYTHON = re.compile(r"^python(?:3(?:\.\d+)?)?$")


class SourceError(ValueError):
    """A source archive that cannot be unpacked (the build's FETCHSOURCE fails)."""


@dataclasses.dataclass(frozen=True)
class DockerBuild:
    """A ``docker build`` step's arguments.

    :param tags: the ``-t`` references, in order.
    :param dockerfile: the ``-f`` path, relative to the step's folder (default: ``Dockerfile``
        in the context).
    :param context: the context folder, relative to the step's folder.
    """

    tags: tuple
    dockerfile: Optional[str]
    context: str


def unpack(archive: bytes, into: Path) -> int:
    """Unpack a ``.tar.gz`` (or plain ``.tar``) source archive into ``into``, as Cloud Build's
    FETCHSOURCE does into ``/workspace``.

    :param archive: the archive's bytes.
    :param into: the folder (created).
    :return: the number of files.
    :raises SourceError: not a tar archive, or a member whose path leaves the folder (absolute,
        ``..``) or that is a link, device or other special file.
    """
    try:
        tar = tarfile.open(fileobj=io.BytesIO(archive), mode="r:*")
    except tarfile.TarError as exc:
        raise SourceError(f"the source is not a tar or tar.gz archive: {exc}") from None
    into.mkdir(parents=True, exist_ok=True)
    files = 0
    with tar:
        for member in tar.getmembers():
            path = posixpath.normpath(member.name)
            if path.startswith(("/", "../")) or path == "..":
                raise SourceError(f"archive member '{member.name}' leaves the workspace")
            if member.isdir():
                (into / path).mkdir(parents=True, exist_ok=True)
            elif member.isfile():
                target = into / path
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(tar.extractfile(member).read())
                target.chmod(0o755 if member.mode & 0o111 else 0o644)
                files += 1
            else:
                raise SourceError(f"archive member '{member.name}' is a link or special file (not unpacked)")
    return files


def docker_build_args(args: list) -> DockerBuild:
    """Read ``docker build`` arguments (``args[0] == "build"``).

    :raises ValueError: not exactly one context path, or an option without its value (the
        message is what docker prints).
    """
    tags, dockerfile, positional = [], None, []
    words = list(args[1:])
    while words:
        word = words.pop(0)
        option, sep, inline = word.partition("=")
        if word.startswith("-") and option in _VALUE_OPTIONS:
            if not sep:
                if not words:
                    raise ValueError(f"flag needs an argument: {option}")
                inline = words.pop(0)
            if option in ("-t", "--tag"):
                tags.append(inline)
            elif option in ("-f", "--file"):
                dockerfile = inline
        elif not word.startswith("-"):
            positional.append(word)
    if len(positional) != 1:
        raise ValueError('"docker build" requires exactly 1 argument: the build context (e.g. ".")')
    return DockerBuild(tuple(tags), dockerfile, positional[0])


def context_digest(context: Path) -> tuple:
    """``("sha256:HEX", size)`` of a build context: every file's relative path and content, in
    path order (the same source gives the same digest, as a reproducible build would).

    :param context: the context folder.
    """
    digest, size = hashlib.sha256(), 0
    for path in sorted(p for p in context.rglob("*") if p.is_file()):
        content = path.read_bytes()
        digest.update(path.relative_to(context).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(content).digest())
        size += len(content)
    return f"sha256:{digest.hexdigest()}", size


def local_argv(argv: tuple, workdir: str, context: Path, program: bool = True) -> tuple:
    """An image's argv as the emulator runs it: a ``python``/``python3`` program becomes the
    emulator's interpreter, and a path under the image's WORKDIR the same path in the context
    folder (which plays WORKDIR).

    :param argv: the ENTRYPOINT or CMD argv.
    :param workdir: the image's absolute WORKDIR.
    :param context: the local context folder.
    :param program: whether ``argv[0]`` is the program (``False`` for a CMD after an ENTRYPOINT).
    """
    prefix = workdir.rstrip("/") + "/"
    out = []
    for index, part in enumerate(argv):
        if index == 0 and program and _PYTHON.match(posixpath.basename(part)):
            out.append(sys.executable)
        elif workdir != "/" and part.startswith(prefix):
            out.append(str(context / part[len(prefix):]))
        else:
            out.append(part)
    return tuple(out)


def image_entry(config: ImageConfig, context: Path) -> ImageEntry:
    """The image table entry of an image built from ``context`` with ``config``: its
    ENTRYPOINT and CMD (see :func:`local_argv`), ENV, and the context folder as its WORKDIR."""
    return ImageEntry(entrypoint=local_argv(config.entrypoint, config.workdir, context),
                      cmd=local_argv(config.cmd, config.workdir, context, program=not config.entrypoint),
                      cwd=context.resolve(), env=config.environment, workdir=config.workdir)
