"""Pieces of the build-from-source example DAG: the source archive, the Artifact Registry
repository and its images, and the teardown of everything the DAG made.

Not a DAG file itself (``.airflowignore`` keeps the DAG processor from parsing it). The I/O with
Artifact Registry is in :class:`ArtifactRepositoryHook` (the google provider has no hook for it;
this one is built like its others, on ``GoogleBaseHook`` and the ``google-cloud-artifact-registry``
client on its default transport, gRPC); the decisions are pure functions, tested by tables.
"""

from __future__ import annotations

import fnmatch
import gzip
import io
import logging
import tarfile
from pathlib import Path, PurePosixPath

from airflow.providers.google.common.consts import CLIENT_INFO
from airflow.providers.google.common.hooks.base_google import GoogleBaseHook

from airflow_gpu_resilience.labels import MANAGED_BY_LABEL, MANAGED_BY_VALUE, is_managed, with_managed_label

log = logging.getLogger(__name__)

#: The folder the example builds by default: the bundled worker, next to this DAGs folder.
WORKER_SOURCE = str(Path(__file__).resolve().parents[1] / "worker")


class RepositoryNotOursError(RuntimeError):
    """An Artifact Registry repository of the requested name exists without our label.

    :param name: the repository's resource name.
    :param labels: its labels.
    """

    def __init__(self, name: str, labels: dict) -> None:
        repository_id, location = name.rsplit("/", 1)[-1], name.split("/")[3]
        super().__init__(
            f"Artifact Registry repository {name!r} already exists and is not this deployment's: it has no label "
            f"{MANAGED_BY_LABEL}={MANAGED_BY_VALUE} (its labels: {labels}). Nothing was changed. Choose another "
            f"`repository` param, or, to let this DAG push to it and delete it when empty, label it: gcloud "
            f"artifacts repositories update {repository_id} --location {location} "
            f"--update-labels={MANAGED_BY_LABEL}={MANAGED_BY_VALUE}")


class SourceFolderError(ValueError):
    """A source folder that cannot be built: missing, not a folder, or without a Dockerfile."""


def check_source_folder(folder: str | Path) -> Path:
    """The ``source_dir`` param checked before anything is made: a folder holding a ``Dockerfile``.

    :param folder: the source folder, on the Airflow worker.
    :return: it, as a path.
    :raises SourceFolderError: it does not exist, is not a folder, or has no ``Dockerfile``
        (Cloud Build's docker step builds from it); the message names ``source_dir``.
    """
    root = Path(folder)
    if not root.exists():
        raise SourceFolderError(f"source_dir {str(folder)!r} does not exist: choose a folder holding a Dockerfile "
                                f"(the default is the bundled worker, {WORKER_SOURCE!r})")
    if not root.is_dir():
        raise SourceFolderError(f"source_dir {str(folder)!r} is not a folder: choose a folder holding a Dockerfile")
    if not (root / "Dockerfile").is_file():
        raise SourceFolderError(f"source_dir {str(folder)!r} has no Dockerfile: Cloud Build's docker step builds "
                                "the image from it. Add one (see worker/Dockerfile) or choose another `source_dir`")
    return root


def ignore_patterns(folder: Path) -> list[str]:
    """The patterns of ``folder/.dockerignore`` (what ``docker build`` leaves out of the context),
    comments and blank lines dropped; ``!`` exceptions are not supported and are dropped too."""
    path = folder / ".dockerignore"
    if not path.is_file():
        return []
    lines = (line.strip() for line in path.read_text().splitlines())
    return [line.strip("/") for line in lines if line and not line.startswith(("#", "!"))]


def ignored(relative: str, patterns: list[str]) -> bool:
    """Whether a path of the context (POSIX, relative) or a folder above it matches a pattern."""
    parts = PurePosixPath(relative).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    return any(fnmatch.fnmatchcase(prefix, pattern) or fnmatch.fnmatchcase(part, pattern)
               for pattern in patterns for prefix, part in zip(prefixes, parts))


def source_archive(folder: str | Path) -> bytes:
    """The build context in ``folder`` as a ``.tar.gz`` for Cloud Build's ``storage_source``:
    every file not ignored by its ``.dockerignore``, in path order, with fixed times and owners,
    so the same source gives the same bytes.

    :param folder: the source folder; it must hold a ``Dockerfile``.
    :return: the archive's bytes.
    :raises SourceFolderError: as :func:`check_source_folder`.
    """
    root = check_source_folder(folder)
    patterns = ignore_patterns(root)
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink()):
            relative = path.relative_to(root).as_posix()
            if ignored(relative, patterns):
                continue
            info = tarfile.TarInfo(relative)
            data = path.read_bytes()
            info.size, info.mode, info.mtime = len(data), 0o755 if path.stat().st_mode & 0o111 else 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def image_uri(project_id: str, region: str, repository: str, image: str) -> str:
    """``REGION-docker.pkg.dev/PROJECT/REPOSITORY/IMAGE``, the image's path in Artifact Registry."""
    return f"{region}-docker.pkg.dev/{project_id}/{repository}/{image}"


def built_image(build: dict, tag_reference: str) -> str:
    """The digest reference (``...IMAGE@sha256:HEX``) of the image a build pushed as ``tag_reference``.

    :param build: the build as the Cloud Build operator returns it (``Build.to_dict``).
    :param tag_reference: ``...IMAGE:TAG``, as in the build's ``images``.
    :raises ValueError: the build did not push that reference.
    """
    for image in build.get("results", {}).get("images", []):
        if image.get("name") == tag_reference and image.get("digest"):
            return f"{tag_reference.rsplit(':', 1)[0]}@{image['digest']}"
    raise ValueError(f"build {build.get('id')} pushed no image {tag_reference!r} "
                     f"(it pushed {[i.get('name') for i in build.get('results', {}).get('images', [])]})")


def repository_action(exists: bool, ours: bool, packages: int) -> str:
    """What the teardown does with the repository: ``"deleted"`` (ours and empty), ``"absent"``,
    ``"not ours, kept"`` or ``"kept: N package(s) left"`` (ours, other images still in it).

    :param exists: whether it exists.
    :param ours: whether it carries our label.
    :param packages: how many images (packages) it still holds.
    """
    if not exists:
        return "absent"
    if not ours:
        return "not ours, kept"
    return "deleted" if packages == 0 else f"kept: {packages} package(s) left"


class ArtifactRepositoryHook(GoogleBaseHook):
    """Artifact Registry Docker repositories and image versions, with the ownership rule of the
    checkpoint bucket: only a repository labelled ``managed-by=airflow-gpu-resilience`` is used or
    deleted.

    :param gcp_conn_id: the Google Cloud connection.
    """

    def get_conn(self):
        """:return: an ``ArtifactRegistryClient`` on the connection's credentials (default endpoint, gRPC)."""
        from google.cloud import artifactregistry_v1

        return artifactregistry_v1.ArtifactRegistryClient(credentials=self.get_credentials(), client_info=CLIENT_INFO,
                                                          client_options=self.get_client_options())

    @staticmethod
    def repository_name(project_id: str, region: str, repository: str) -> str:
        return f"projects/{project_id}/locations/{region}/repositories/{repository}"

    def ensure_repository(self, project_id: str, region: str, repository: str) -> dict:
        """Create the Docker repository, labelled ours, unless it exists and is ours.

        :return: ``{"repository": name, "created": bool}``.
        :raises RepositoryNotOursError: it exists without our label (nothing is changed).
        """
        from google.api_core.exceptions import NotFound
        from google.cloud import artifactregistry_v1

        client, name = self.get_conn(), self.repository_name(project_id, region, repository)
        try:
            found = client.get_repository(name=name)
        except NotFound:
            repo = artifactregistry_v1.Repository(format_=artifactregistry_v1.Repository.Format.DOCKER,
                                                  labels=with_managed_label({"gcp-project": project_id}),
                                                  description="Images built by airflow-gpu-resilience DAGs")
            client.create_repository(parent=name.rsplit("/repositories/", 1)[0], repository_id=repository,
                                     repository=repo).result(timeout=300)
            self.log.info("Created Artifact Registry repository %s", name)
            return {"repository": name, "created": True}
        if not is_managed(found.labels):
            raise RepositoryNotOursError(name, dict(found.labels))
        return {"repository": name, "created": False}

    def delete_run_image(self, tag_reference: str, digest: str) -> list[str]:
        """Delete what one run pushed and nothing another run still uses: the run's tag, then the
        version it named when no other tag names it, then the image (package) when no version is
        left. Another build of the same source pushes the same digest, so the version may carry
        another run's tag: it is then kept. A tag or version already gone is skipped.

        :param tag_reference: ``REGION-docker.pkg.dev/P/R/IMAGE:TAG``, the run's tag.
        :param digest: ``sha256:HEX``, the version the run's build pushed.
        :return: the references deleted: ``...IMAGE:TAG`` when the tag was, ``...IMAGE@sha256:HEX``
            when the version was too.
        """
        from google.api_core.exceptions import FailedPrecondition, NotFound

        path, tag = tag_reference.rsplit(":", 1)
        host, project_id, repository, image = path.split("/", 3)
        package = (f"{self.repository_name(project_id, host.removesuffix('-docker.pkg.dev'), repository)}"
                   f"/packages/{image.replace('/', '%2F')}")
        version, client, deleted = f"{package}/versions/{digest}", self.get_conn(), []
        try:
            client.delete_tag(name=f"{package}/tags/{tag}")
            deleted.append(tag_reference)
        except NotFound:
            self.log.info("Tag %s is already gone", tag_reference)
        others = sorted(t.name.rsplit("/", 1)[-1] for t in client.list_tags(parent=package) if t.version == version)
        if others:
            self.log.info("Kept image %s@%s: tagged %s by other runs", path, digest, others)
            return deleted
        try:  # without force: a tag added since the listing keeps the version
            client.delete_version(request={"name": version, "force": False}).result(timeout=300)
            deleted.append(f"{path}@{digest}")
        except NotFound:
            self.log.info("Image %s@%s is already gone", path, digest)
        except FailedPrecondition as error:
            self.log.info("Kept image %s@%s: %s", path, digest, error.message)
            return deleted
        if not list(client.list_versions(parent=package)):
            try:
                client.delete_package(name=package).result(timeout=300)
            except NotFound:
                pass
        self.log.info("Deleted %s", deleted or "nothing")
        return deleted

    def delete_repository_if_ours_and_empty(self, project_id: str, region: str, repository: str) -> str:
        """Delete the repository when it is ours and holds no image.

        :return: what was done (see :func:`repository_action`).
        """
        from google.api_core.exceptions import NotFound

        client, name = self.get_conn(), self.repository_name(project_id, region, repository)
        try:
            found = client.get_repository(name=name)
        except NotFound:
            return repository_action(False, False, 0)
        ours = is_managed(found.labels)
        action = repository_action(True, ours, len(list(client.list_packages(parent=name))) if ours else 0)
        if action == "deleted":
            client.delete_repository(name=name).result(timeout=300)
        self.log.info("Artifact Registry repository %s: %s", name, action)
        return action
