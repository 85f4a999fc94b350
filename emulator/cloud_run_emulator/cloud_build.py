"""Cloud Build (``google.devtools.cloudbuild.v1.CloudBuild``): builds from a source archive in
the emulated Cloud Storage whose Dockerfile becomes an entry of the image table.

Served on the gRPC port (and ``--google-endpoint``'s ``LOCATION-cloudbuild.googleapis.com:443``)
for ``google-cloud-build`` and the Airflow google provider's ``CloudBuildHook`` and
``CloudBuildCreateBuildOperator``: CreateBuild (its long-running operation, with
``BuildOperationMetadata``, done when the build ends: the Build as response, or, for a build that
did not succeed, the error Cloud Build sets, ``UNKNOWN`` "Build failed; check build logs for
details"), GetBuild (by name, or by project and id as the hook asks) and ListBuilds; the
operation is polled with ``google.longrunning.Operations`` like Cloud Run's
(:mod:`.service_operations`). Builds are regional: the parent's location must be a region
(``projects/P/locations/us-central1``; ``global`` is refused with INVALID_ARGUMENT).

A build runs on a thread of the emulator, as Cloud Build's phases:

1. FETCHSOURCE: ``source.storage_source`` (a ``.tar.gz`` object in the emulated Cloud Storage) is
   unpacked into ``DATA_DIR/builds/ID/workspace`` (a missing object, or an archive with links or
   paths leaving the folder: FAILURE, ``FETCH_SOURCE_FAILED``).
2. BUILD: each step in order. ``gcr.io/cloud-builders/docker build [-t REF]... [-f FILE] CONTEXT``
   reads the Dockerfile (:mod:`.dockerfile`: ENTRYPOINT, CMD, WORKDIR, ENV) and makes the image:
   its digest is ``sha256`` of the context's files (:func:`~.build_steps.context_digest`), its
   command the Dockerfile's, run in the context folder, which plays WORKDIR
   (:func:`~.build_steps.image_entry`). ``docker push REF`` pushes one. A Dockerfile missing or
   rejected, or any other builder, fails the step (exit status 1): FAILURE, ``USER_BUILD_STEP``,
   with the step's log, as Cloud Build words it.
3. PUSH: every reference in ``images`` not pushed yet is pushed to Artifact Registry
   (:meth:`~.artifact_registry.ArtifactRegistryService.push`: its repository must exist; else
   FAILURE, ``PUSH_FAILED``); one never built fails with ``PUSH_IMAGE_NOT_FOUND``.
   ``results.images`` lists what was pushed with its digest.

The log is kept in ``DATA_DIR/builds/ID/log.txt`` (``log_url``) and, with ``logs_bucket``
(``gs://BUCKET[/PREFIX]``, which must exist), written to ``log-ID.txt`` there, as Cloud Build does.

Not emulated: base images and layers (``FROM`` is not pulled: the emulator's Python and the
installed packages stand in for the base image), ``RUN`` (not run), ``COPY``/``ADD`` (the context
as a whole plays WORKDIR), builders other than docker, repository and inline sources, build
triggers, worker pools, substitutions, timeouts, CancelBuild, RetryBuild, approvals, secrets, IAM
and service accounts, and registries other than Artifact Registry (``gcr.io``, Docker Hub).
"""

from __future__ import annotations

import posixpath
import threading
import uuid
from pathlib import Path

from google.cloud.devtools import cloudbuild_v1 as cb

from . import service_operations
from .artifact_registry import ArtifactRegistryService
from .backend import paginate
from .build_steps import DOCKER_BUILDER, SourceError, context_digest, docker_build_args, image_entry, unpack
from .dockerfile import DockerfileError, parse_dockerfile
from .exceptions import InvalidArgument, NotFound
from .models import utcnow
from .rpcs import Rpc

SERVICE = "google.devtools.cloudbuild.v1.CloudBuild"
#: The error of a build's operation when the build did not succeed (google.rpc.Code UNKNOWN).
FAILED_BUILD_ERROR = (2, "Build failed; check build logs for details")
_Status = cb.Build.Status
_Failure = cb.Build.FailureInfo.FailureType


class BuildFailed(Exception):
    """Ends a build: its failure type and the detail Cloud Build reports."""

    def __init__(self, failure: _Failure, detail: str) -> None:
        super().__init__(detail)
        self.failure, self.detail = failure, detail


class CloudBuildService:
    """Builds of every project and location (the API methods run under the registry's lock,
    as :func:`~.rpcs.call` runs them; the build threads take it for every change).

    :param registry: the emulator's :class:`~.backend.Registry` (its lock, the backends that
        keep the operations, the data folder and the Cloud Storage service).
    :param artifacts: where images are pushed.
    """

    def __init__(self, registry, artifacts: ArtifactRegistryService) -> None:
        self.registry = registry
        self.artifacts = artifacts
        self.builds: dict = {}  # (project, id) -> cb.Build

    # --- API methods ---------------------------------------------------------------------
    def create_build(self, backend, r: cb.CreateBuildRequest):
        source = r.build.source.storage_source
        if not source.bucket or not source.object_:
            raise InvalidArgument("build.source: the emulator builds from a storage_source (bucket and object) only.")
        if not r.build.steps:
            raise InvalidArgument("invalid build: build must have at least one step")
        project = backend.parent.split("/")[1]
        if r.project_id and r.project_id != project:
            raise InvalidArgument(f"project_id '{r.project_id}' does not match parent '{r.parent}'.")
        logs = self._logs_place(r.build.logs_bucket)
        build = cb.Build(r.build)
        build.id = str(uuid.uuid4())
        build.name, build.project_id = f"{backend.parent}/builds/{build.id}", project
        build.status, build.create_time = _Status.QUEUED, utcnow()
        build.log_url = (self._folder(build.id) / "log.txt").as_uri()
        self.builds[(project, build.id)] = build
        op = service_operations.start(backend, lambda: cb.BuildOperationMetadata(build=build), lambda: build,
                                      done=False)
        threading.Thread(target=self._run, args=(build, op, logs), name=f"build-{build.id[:8]}", daemon=True).start()
        return op.to_pb()

    def locate(self, r) -> str:
        """The name of the build a GetBuild request means (by ``name``, or project and id).

        :raises NotFound: no build of that project and id.
        """
        if r.name:
            return r.name
        build = self.builds.get((r.project_id, r.id))
        if build is None:
            raise NotFound(f"Build '{r.id}' of project '{r.project_id}' was not found.")
        return build.name

    def get_build(self, backend, r: cb.GetBuildRequest) -> cb.Build:
        project, _, _, _, build_id = (self.locate(r).split("/") + [""] * 5)[1:6]
        build = self.builds.get((project, build_id))
        if build is None:
            raise NotFound(f"Build '{build_id}' of project '{project}' was not found.")
        return build

    def list_builds(self, backend, r: cb.ListBuildsRequest) -> cb.ListBuildsResponse:
        builds = sorted((b for b in self.builds.values() if b.name.startswith(f"{backend.parent}/")),
                        key=lambda b: b.create_time, reverse=True)
        page, token = paginate(builds, r.page_size, r.page_token)
        return cb.ListBuildsResponse(builds=page, next_page_token=token)

    def reset(self) -> None:
        """Forget every build (the caller holds the registry's lock). A build still running
        goes on to its end on its own thread, unlisted; its push then finds no repository."""
        self.builds.clear()

    def rpcs(self) -> list:
        """The served methods, as :class:`~.rpcs.Rpc` entries bound to this service."""
        return [
            Rpc(SERVICE, "CreateBuild", cb.CreateBuildRequest, self.create_build, mutating=True, resource="parent"),
            Rpc(SERVICE, "GetBuild", cb.GetBuildRequest, self.get_build, locate=self.locate),
            Rpc(SERVICE, "ListBuilds", cb.ListBuildsRequest, self.list_builds, resource="parent"),
        ]

    # --- a build's run -------------------------------------------------------------------
    def _folder(self, build_id: str) -> Path:
        return Path(self.registry.config.data_dir, "builds", build_id)

    def _logs_place(self, logs_bucket: str):
        """``(bucket, prefix)`` of a ``logs_bucket`` value, or ``None`` when empty.

        :raises InvalidArgument: the bucket does not exist.
        """
        if not logs_bucket:
            return None
        bucket, _, prefix = logs_bucket.removeprefix("gs://").partition("/")
        if not self.registry.config.gcs.bucket_exists(bucket):
            raise InvalidArgument(f"build.logs_bucket: bucket '{bucket}' does not exist.")
        return bucket, prefix.strip("/")

    def _run(self, build: cb.Build, op, logs) -> None:
        log = [f'starting build "{build.id}"', ""]
        with self.registry.cond:
            build.status, build.start_time = _Status.WORKING, utcnow()
        try:
            workspace = self._fetch(build, log)
            pushed = self._steps(build, workspace, log)
            results = self._push(build, pushed, log)
            status, failure, detail = _Status.SUCCESS, None, ""
            log.append("DONE")
        except BuildFailed as failed:
            results, status, failure, detail = cb.Results(), _Status.FAILURE, failed.failure, failed.detail
            log += [f"ERROR: {failed.detail}", "ERROR", "FAILURE"] if failure == _Failure.USER_BUILD_STEP \
                else [f"ERROR: {failed.detail}", "FAILURE"]
        except Exception as exc:  # an emulator bug: the build ends, as Cloud Build's internal errors do
            detail = f"{type(exc).__name__}: {exc}"
            results, status, failure = cb.Results(), _Status.INTERNAL_ERROR, None
            log.append(f"ERROR: internal error: {detail}")
        self._write_log(build, log, logs)
        with self.registry.cond:
            build.results, build.status, build.finish_time = results, status, utcnow()
            if failure is not None:
                build.status_detail = detail if failure != _Failure.USER_BUILD_STEP else f"Build step failure: {detail}"
                build.failure_info = cb.Build.FailureInfo(type_=failure, detail=build.status_detail)
            op.done, op.error = True, (None if status == _Status.SUCCESS else FAILED_BUILD_ERROR)
            self.registry.cond.notify_all()

    def _fetch(self, build: cb.Build, log: list) -> Path:
        source = build.source.storage_source
        uri = f"gs://{source.bucket}/{source.object_}"
        log += ["FETCHSOURCE", f"Fetching storage object: {uri}"]
        gcs = self.registry.config.gcs
        path = gcs.bucket_dir(source.bucket) / source.object_ if gcs.bucket_exists(source.bucket) else None
        if path is None or not path.is_file():
            raise BuildFailed(_Failure.FETCH_SOURCE_FAILED, f"failed to fetch source: {uri}: object not found")
        workspace = self._folder(build.id) / "workspace"
        try:
            files = unpack(path.read_bytes(), workspace)
        except SourceError as exc:
            raise BuildFailed(_Failure.FETCH_SOURCE_FAILED, f"failed to unpack {uri}: {exc}") from None
        log.append(f"Extracted {files} files from {uri}")
        return workspace

    def _steps(self, build: cb.Build, workspace: Path, log: list) -> dict:
        log.append("BUILD")
        images: dict = {}  # reference -> (digest, entry, size)
        for index, step in enumerate(build.steps):
            log.append(f"Starting Step #{index}" + (f' - "{step.id}"' if step.id else ""))
            lines, code = self._step(step, workspace / step.dir_, images)
            log += [f"Step #{index}: {line}" for line in lines]
            with self.registry.cond:
                step.status, step.exit_code = (_Status.SUCCESS, 0) if code == 0 else (_Status.FAILURE, code)
            if code:
                log.append(f"Finished Step #{index}")
                raise BuildFailed(_Failure.USER_BUILD_STEP, f'build step {index} "{step.name}" failed: '
                                  f"step exited with non-zero status: {code}")
            log.append(f"Finished Step #{index}")
        return images

    def _step(self, step: cb.BuildStep, folder: Path, images: dict) -> tuple:
        """Run one step: ``(log lines, exit status)``."""
        if not DOCKER_BUILDER.match(step.name):
            return [f"the emulator runs gcr.io/cloud-builders/docker steps only; builder '{step.name}' "
                    "is not emulated"], 1
        args = list(step.args)
        if args[:1] == ["push"] and len(args) == 2:
            return self._docker_push(args[1], images)
        if args[:1] != ["build"]:
            return [f"docker {' '.join(args[:1])}: only 'docker build' and 'docker push REF' are emulated"], 1
        try:
            spec = docker_build_args(args)
        except ValueError as exc:
            return [f"ERROR: {exc}"], 1
        context = (folder / spec.context).resolve()
        dockerfile = folder / spec.dockerfile if spec.dockerfile else context / "Dockerfile"
        if not context.is_dir():
            return [f"unable to prepare context: path \"{spec.context}\" not found"], 1
        if not dockerfile.is_file():
            shown = posixpath.normpath(posixpath.join("/workspace", step.dir_, spec.dockerfile or
                                                      posixpath.join(spec.context, "Dockerfile")))
            return ["unable to prepare context: unable to evaluate symlinks in Dockerfile path: "
                    f"lstat {shown}: no such file or directory"], 1
        try:
            config = parse_dockerfile(dockerfile.read_text(errors="replace"))
        except DockerfileError as exc:
            return [f"Error response from daemon: {exc}"], 1
        digest, size = context_digest(context)
        entry = image_entry(config, context)
        for tag in spec.tags:
            images[tag] = (digest, entry, size, False)
        return [f"Sending build context to Docker daemon  {size} bytes",
                f"Successfully built {digest[7:19]}"] + [f"Successfully tagged {tag}" for tag in spec.tags], 0

    def _docker_push(self, reference: str, images: dict) -> tuple:
        if reference not in images:
            return [f"An image does not exist locally with the tag: {reference}"], 1
        digest, entry, size, _ = images[reference]
        try:
            with self.registry.cond:
                self.artifacts.push(reference, digest, entry, size)
        except ValueError as exc:
            return [f"The push refers to repository [{reference}]", str(exc)], 1
        images[reference] = (digest, entry, size, True)
        return [f"The push refers to repository [{reference}]", f"latest: digest: {digest} size: {size}"], 0

    def _push(self, build: cb.Build, images: dict, log: list) -> cb.Results:
        results = cb.Results()
        if build.images:
            log.append("PUSH")
        missing = [ref for ref in build.images if ref not in images]
        if missing:
            raise BuildFailed(_Failure.PUSH_IMAGE_NOT_FOUND, "failed to find one or more images after execution of "
                              f"build steps: {missing}")
        for reference in build.images:
            digest, entry, size, pushed = images[reference]
            if not pushed:
                log.append(f"Pushing {reference}")
                try:
                    with self.registry.cond:
                        self.artifacts.push(reference, digest, entry, size)
                except ValueError as exc:
                    raise BuildFailed(_Failure.PUSH_FAILED, f'error pushing image "{reference}": {exc}') from None
            results.images.append(cb.BuiltImage(name=reference, digest=digest))
        return results

    def _write_log(self, build: cb.Build, log: list, logs) -> None:
        text = "\n".join(log) + "\n"
        folder = self._folder(build.id)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "log.txt").write_text(text)
        if logs is not None:
            bucket, prefix = logs
            gcs = self.registry.config.gcs
            target = gcs.bucket_dir(bucket) / prefix / f"log-{build.id}.txt"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
            gcs.reconcile([bucket])


def services(registry) -> tuple:
    """The Cloud Build and Artifact Registry services of an emulator, over its image table: their
    methods (``rpcs()``) are what :func:`~.grpc_server.start` serves beside Cloud Run's, and
    ``reset()`` forgets their resources (``POST /_emulator/reset``).

    :param registry: the emulator's :class:`~.backend.Registry`.
    :return: ``(CloudBuildService, ArtifactRegistryService)``.
    """
    artifacts = ArtifactRegistryService(registry.config.images)
    return CloudBuildService(registry, artifacts), artifacts
