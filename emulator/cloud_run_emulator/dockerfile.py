"""What the emulator reads from a Dockerfile: the image's ENTRYPOINT, CMD, WORKDIR and ENV.

A pure parser (no I/O), used by the Cloud Build emulator (:mod:`.cloud_build`) to turn a build's
Dockerfile into an entry of the image table (:mod:`.images`). It follows the Dockerfile reference
(https://docs.docker.com/reference/dockerfile/) for what it reads:

- lines continue with a trailing ``\\``; a line starting with ``#`` is a comment; instructions are
  case-insensitive; an instruction the reference does not define is an error, as in
  ``docker build`` ("unknown instruction");
- the first instruction other than ``ARG`` must be ``FROM``; each ``FROM`` starts a stage, and a
  ``FROM`` naming an earlier stage (``FROM builder``) starts from that stage's settings; the
  image is the last stage's;
- ``ENTRYPOINT`` and ``CMD`` in exec form (a JSON array of strings) are taken as they are; in
  shell form they become ``["/bin/sh", "-c", TEXT]``; ``ENTRYPOINT`` clears a ``CMD`` set before
  it in an earlier stage it inherits (a base image's, as Docker does);
- ``WORKDIR`` resolves a relative path against the one before it (``/`` at first);
- ``ENV KEY=VALUE ...`` (quotes as in a shell) and the legacy ``ENV KEY VALUE``; ``$VAR`` and
  ``${VAR}`` in ``ENV`` and ``WORKDIR`` values expand from the ``ENV`` and ``ARG`` seen before.

Not read: what ``FROM`` names outside the file (base images: no entrypoint, command, working
directory or environment of theirs is inherited), ``RUN``, ``COPY``/``ADD`` (the build context
plays the working directory, see :mod:`.cloud_build`), ``USER``, ``SHELL``, parser directives,
heredocs, ``ONBUILD``.
"""

from __future__ import annotations

import dataclasses
import json
import posixpath
import re
import shlex

#: Instructions of the Dockerfile reference.
INSTRUCTIONS = frozenset({
    "ADD", "ARG", "CMD", "COPY", "ENTRYPOINT", "ENV", "EXPOSE", "FROM", "HEALTHCHECK", "LABEL",
    "MAINTAINER", "ONBUILD", "RUN", "SHELL", "STOPSIGNAL", "USER", "VOLUME", "WORKDIR",
})
_VAR = re.compile(r"\$(?:\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)\}|(?P<plain>[A-Za-z_][A-Za-z0-9_]*))")


class DockerfileError(ValueError):
    """A Dockerfile ``docker build`` would reject; the message is in its words, with the line."""


@dataclasses.dataclass(frozen=True)
class ImageConfig:
    """The settings an image's Dockerfile gives it.

    :param entrypoint: ENTRYPOINT argv, ``()`` when not set.
    :param cmd: CMD argv, ``()`` when not set.
    :param workdir: the absolute WORKDIR, ``"/"`` when not set.
    :param env: ENV, in the order set.
    """

    entrypoint: tuple = ()
    cmd: tuple = ()
    workdir: str = "/"
    env: tuple = ()

    @property
    def environment(self) -> dict:
        """:attr:`env` as a mapping."""
        return dict(self.env)


def logical_lines(text: str) -> list:
    """``[(line_number, text)]`` of a Dockerfile's instructions: continuations joined, comments
    and blank lines dropped; the number is the instruction's first line (1-based)."""
    lines, pending, start = [], "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # comment lines inside a continued instruction are dropped
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        lines.append((start, (pending + stripped).strip()))
        pending = ""
    if pending.strip():
        lines.append((start, pending.strip()))
    return lines


def expand(value: str, variables: dict) -> str:
    """``$VAR`` and ``${VAR}`` replaced from ``variables`` (unknown names become ``""``)."""
    return _VAR.sub(lambda m: variables.get(m.group("braced") or m.group("plain"), ""), value)


def command_form(line: int, instruction: str, value: str) -> tuple:
    """The argv of a ``CMD`` or ``ENTRYPOINT`` value: exec form (JSON array) or shell form.

    :raises DockerfileError: a JSON array holding something else than strings.
    """
    if value.startswith("["):
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = None  # not JSON: Docker takes the text in shell form
        if isinstance(parsed, list):
            if not all(isinstance(part, str) for part in parsed):
                raise DockerfileError(f"dockerfile parse error on line {line}: {instruction} array "
                                      "must hold strings only")
            return tuple(parsed)
    return ("/bin/sh", "-c", value) if value else ()


def env_pairs(line: int, value: str, variables: dict) -> list:
    """``[(key, value)]`` of an ``ENV`` instruction's text (``K=V ...`` or legacy ``K V``).

    :raises DockerfileError: ``ENV`` without a value, or a ``K=V`` form with a word lacking ``=``.
    """
    try:
        words = shlex.split(value, posix=True)
    except ValueError as exc:
        raise DockerfileError(f"dockerfile parse error on line {line}: ENV: {exc}") from None
    if not words:
        raise DockerfileError(f"dockerfile parse error on line {line}: ENV requires at least one argument")
    if "=" not in words[0]:
        key, _, rest = value.partition(" ")
        if not rest.strip():
            raise DockerfileError(f"dockerfile parse error on line {line}: ENV must have two arguments")
        return [(key, expand(rest.strip(), variables))]
    pairs = []
    for word in words:
        key, sep, val = word.partition("=")
        if not sep or not key:
            raise DockerfileError(f"dockerfile parse error on line {line}: ENV names can not be blank"
                                  if not key else f"dockerfile parse error on line {line}: "
                                  f"ENV: '{word}' is not of the form KEY=VALUE")
        pairs.append((key, expand(val, variables)))
    return pairs


def _stage_start(line: int, value: str, stages: dict) -> tuple:
    """``(stage name or "", settings it starts from)`` of a ``FROM`` instruction."""
    words = value.split()
    words = [w for w in words if not w.startswith("--")]  # --platform=...
    if not words:
        raise DockerfileError(f"dockerfile parse error on line {line}: FROM requires either one or three arguments")
    name = words[2].lower() if len(words) == 3 and words[1].lower() == "as" else ""
    if len(words) not in (1, 3) or (len(words) == 3 and not name):
        raise DockerfileError(f"dockerfile parse error on line {line}: FROM requires either one or three arguments")
    return name, stages.get(words[0].lower(), ImageConfig())


def parse_dockerfile(text: str) -> ImageConfig:
    """The image settings a Dockerfile gives (see the module docs for what is read).

    :param text: the Dockerfile's content.
    :return: the last stage's :class:`ImageConfig`.
    :raises DockerfileError: no instructions, an unknown instruction, an instruction before the
        first ``FROM`` (other than ``ARG``), or a malformed ``FROM``, ``ENV``, ``CMD`` or
        ``ENTRYPOINT``; the message names the line.
    """
    lines = logical_lines(text)
    if not lines:
        raise DockerfileError("the Dockerfile cannot be empty (file with no instructions)")
    stages: dict = {}
    config, variables, started, stage, cmd_here = None, {}, False, "", False
    for line, content in lines:
        instruction, _, value = content.partition(" ")
        instruction, value = instruction.upper(), value.strip()
        if instruction not in INSTRUCTIONS:
            raise DockerfileError(f"dockerfile parse error on line {line}: unknown instruction: {instruction}")
        if instruction == "FROM":
            stage, config = _stage_start(line, value, stages)
            variables, started, cmd_here = {**variables, **config.environment}, True, False
        elif not started and instruction == "ARG":
            variables.update(_arg(value, variables))
            continue
        elif not started:
            raise DockerfileError(f"dockerfile parse error on line {line}: no build stage in current context "
                                  f"({instruction} before the first FROM)")
        else:
            kept_cmd = config.cmd if instruction == "ENTRYPOINT" and cmd_here else ()
            config = _apply(line, instruction, value, config, variables)
            if kept_cmd:  # a CMD of this stage stays; an inherited one is cleared (Docker's rule)
                config = dataclasses.replace(config, cmd=kept_cmd)
            cmd_here = cmd_here or instruction == "CMD"
        if stage:
            stages[stage] = config
    return config


def _arg(value: str, variables: dict) -> dict:
    key, sep, default = value.partition("=")
    return {key.strip(): expand(default.strip().strip('"'), variables)} if key.strip() else {}


def _apply(line: int, instruction: str, value: str, config: ImageConfig, variables: dict) -> ImageConfig:
    """``config`` after one instruction of a stage (``variables`` gains ``ENV`` and ``ARG``)."""
    if instruction == "ENTRYPOINT":
        return dataclasses.replace(config, entrypoint=command_form(line, instruction, value), cmd=())
    if instruction == "CMD":
        return dataclasses.replace(config, cmd=command_form(line, instruction, value))
    if instruction == "WORKDIR":
        if not value:
            raise DockerfileError(f"dockerfile parse error on line {line}: WORKDIR requires exactly one argument")
        path = posixpath.normpath(posixpath.join(config.workdir, expand(value, variables)))
        return dataclasses.replace(config, workdir=path)
    if instruction == "ENV":
        pairs = env_pairs(line, value, variables)
        variables.update(pairs)
        env = dict(config.env)
        env.update(pairs)
        return dataclasses.replace(config, env=tuple(env.items()))
    if instruction == "ARG":
        variables.update(_arg(value, variables))
    return config
