"""Artifact Registry (``google.devtools.artifactregistry.v1.ArtifactRegistry``): Docker
repositories and the images Cloud Build pushes to them, for ``google-cloud-artifact-registry``.

Served on the gRPC port (and ``--google-endpoint``'s ``artifactregistry.googleapis.com:443``),
with the same request and resource names as Google's:

- repositories ``projects/P/locations/L/repositories/R``: CreateRepository (a done operation
  with the Repository; Docker format only, labels and description kept), GetRepository,
  ListRepositories, DeleteRepository (with everything in it, as Google's does);
- what the Cloud Build emulator pushed (:meth:`ArtifactRegistryService.push`), seen as Docker
  images (``.../dockerImages/IMAGE@sha256:HEX``: ListDockerImages, GetDockerImage), packages
  (``.../packages/IMAGE``: ListPackages, GetPackage, DeletePackage), versions
  (``.../packages/IMAGE/versions/sha256:HEX``: ListVersions, GetVersion, DeleteVersion, which
  refuses a tagged version unless ``force``) and tags (``.../packages/IMAGE/tags/TAG``: ListTags,
  GetTag, DeleteTag, which removes the tag only, its version staying). An image name with ``/`` is
  URL-encoded in resource names (``%2F``), as Google's are.

An image pushed here becomes an entry of the emulator's image table under its references
``LOCATION-docker.pkg.dev/P/R/IMAGE@sha256:HEX`` and ``...:TAG``, so a job deployed with either
runs the built command; deleting the version, its package or its repository removes them, so a
job deployed with a deleted image fails at run time, naming the image.

Not emulated: any format but Docker, remote and virtual repositories, the Docker registry
protocol itself (no ``docker pull`` or ``push``: only Cloud Build pushes, and image layers,
manifests and sizes are not real), cleanup policies, IAM, KMS, multi-regional locations
(``us``, ``europe``: the location must be a region), filters and ``order_by``.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
from typing import Optional
from urllib.parse import quote, unquote

from google.cloud import artifactregistry_v1 as ar
from google.protobuf import empty_pb2

from . import service_operations
from .backend import paginate
from .exceptions import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from .images import ImageEntry, ImageTable
from .models import utcnow
from .rpcs import Rpc

SERVICE = "google.devtools.artifactregistry.v1.ArtifactRegistry"
#: A repository id: lowercase letters, digits and hyphens, starting with a letter, at most 63.
REPOSITORY_ID = re.compile(r"^[a-z]([a-z0-9-]{0,61}[a-z0-9])?$")
REPOSITORY = re.compile(r"^projects/(?P<p>[^/]+)/locations/(?P<l>[^/]+)/repositories/(?P<r>[^/]+)$")
#: ``LOCATION-docker.pkg.dev/PROJECT/REPOSITORY/IMAGE[:TAG]``.
IMAGE_URI = re.compile(r"^(?P<l>[a-z0-9-]+)-docker\.pkg\.dev/(?P<p>[^/]+)/(?P<r>[^/]+)/"
                       r"(?P<image>[a-z0-9][a-z0-9._/-]*?)(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}))?$")


@dataclasses.dataclass
class StoredImage:
    """One pushed image version.

    :param repository: the repository's resource name.
    :param image: the image name inside it (``trainer``, ``team/trainer``).
    :param digest: ``sha256:HEX``.
    :param entry: what a job deployed with it runs.
    :param size: its size in bytes (the build context's; layers are not made).
    """

    repository: str
    image: str
    digest: str
    entry: ImageEntry
    size: int = 0
    tags: set = dataclasses.field(default_factory=set)
    upload_time: dt.datetime = dataclasses.field(default_factory=utcnow)

    @property
    def host_path(self) -> str:
        """``LOCATION-docker.pkg.dev/P/R/IMAGE``."""
        match = REPOSITORY.match(self.repository)
        return f"{match['l']}-docker.pkg.dev/{match['p']}/{match['r']}/{self.image}"

    @property
    def package_name(self) -> str:
        return f"{self.repository}/packages/{quote(self.image, safe='')}"

    def references(self) -> list:
        """The image table keys this version is registered under."""
        return [f"{self.host_path}@{self.digest}"] + [f"{self.host_path}:{tag}" for tag in sorted(self.tags)]

    def docker_image(self) -> ar.DockerImage:
        return ar.DockerImage(
            name=f"{self.repository}/dockerImages/{quote(self.image, safe='')}@{self.digest}",
            uri=f"{self.host_path}@{self.digest}", tags=sorted(self.tags), image_size_bytes=self.size,
            upload_time=self.upload_time, build_time=self.upload_time, update_time=self.upload_time,
            media_type="application/vnd.docker.distribution.manifest.v2+json")

    def version(self) -> ar.Version:
        return ar.Version(name=f"{self.package_name}/versions/{self.digest}", create_time=self.upload_time,
                          update_time=self.upload_time,
                          related_tags=[ar.Tag(name=f"{self.package_name}/tags/{t}",
                                               version=f"{self.package_name}/versions/{self.digest}")
                                        for t in sorted(self.tags)])


def parse_image_uri(uri: str) -> Optional[tuple]:
    """``(repository name, image, tag or None)`` of an Artifact Registry Docker image URI, or
    ``None`` when ``uri`` is not of the form ``LOCATION-docker.pkg.dev/P/R/IMAGE[:TAG]``."""
    match = IMAGE_URI.match(uri)
    if not match:
        return None
    return f"projects/{match['p']}/locations/{match['l']}/repositories/{match['r']}", match["image"], match["tag"]


def _split(name: str, kind: str, suffix: str) -> tuple:
    """``(repository name, image, rest)`` of a package, version, tag or Docker image name."""
    match = re.match(rf"^(projects/[^/]+/locations/[^/]+/repositories/[^/]+)/{suffix}$", name)
    if not match:
        raise InvalidArgument(f"name: '{name}' is not a {kind} name.")
    return match.group(1), unquote(match.group(2)), match.group(3) if match.lastindex >= 3 else None


class ArtifactRegistryService:
    """Repositories and pushed images of every project and location (the caller holds the
    registry's lock for every method, as :func:`~.rpcs.call` does).

    :param images: the emulator's image table, which pushed images are registered in.
    """

    def __init__(self, images: ImageTable) -> None:
        self.table = images
        self.repositories: dict = {}
        self.images: dict = {}  # repository name -> {(image, digest): StoredImage}

    # --- repositories --------------------------------------------------------------------
    def repository(self, name: str) -> ar.Repository:
        """:raises NotFound: no such repository."""
        if name not in self.repositories:
            raise NotFound(f"Requested entity was not found: repository '{name}'.")
        return self.repositories[name]

    def create_repository(self, backend, r: ar.CreateRepositoryRequest):
        if not REPOSITORY_ID.match(r.repository_id):
            raise InvalidArgument(f"repository_id: '{r.repository_id}' must be 1-63 lowercase letters, digits or "
                                  "hyphens, starting with a letter and not ending with a hyphen.")
        if r.repository.format_ != ar.Repository.Format.DOCKER:
            raise InvalidArgument("repository.format: the emulator serves DOCKER repositories only.")
        name = f"{r.parent}/repositories/{r.repository_id}"
        if name in self.repositories:
            raise AlreadyExists(f"the repository already exists: {name}")
        repo = ar.Repository(r.repository)
        location = REPOSITORY.match(name)
        repo.name, repo.create_time, repo.update_time = name, utcnow(), utcnow()
        repo.registry_uri = f"{location['l']}-docker.pkg.dev/{location['p']}/{location['r']}"
        self.repositories[name] = repo
        self.images[name] = {}
        response = lambda: self.repositories.get(name, repo)  # noqa: E731  (read at each poll)
        return service_operations.start(backend, ar.OperationMetadata, response).to_pb()

    def list_repositories(self, backend, r: ar.ListRepositoriesRequest) -> ar.ListRepositoriesResponse:
        repos = [repo for name, repo in sorted(self.repositories.items()) if name.startswith(f"{r.parent}/")]
        page, token = paginate(repos, r.page_size, r.page_token)
        return ar.ListRepositoriesResponse(repositories=page, next_page_token=token)

    def delete_repository(self, backend, r: ar.DeleteRepositoryRequest):
        self.repository(r.name)
        for stored in list(self.images[r.name].values()):
            self._forget(stored)
        del self.repositories[r.name], self.images[r.name]
        return service_operations.start(backend, ar.OperationMetadata, empty_pb2.Empty).to_pb()

    # --- images ------------------------------------------------------------------------
    def push(self, uri: str, digest: str, entry: ImageEntry, size: int) -> StoredImage:
        """Store an image Cloud Build built and register it in the image table.

        :param uri: ``LOCATION-docker.pkg.dev/P/R/IMAGE[:TAG]``.
        :param digest: ``sha256:HEX``.
        :param entry: what it runs.
        :param size: its size in bytes.
        :return: the stored version.
        :raises ValueError: ``uri`` is not an Artifact Registry Docker image, or its repository
            does not exist (the message is what the push step logs).
        """
        parsed = parse_image_uri(uri)
        if parsed is None:
            raise ValueError(f"{uri}: the emulator pushes to Artifact Registry only (LOCATION-docker.pkg.dev/"
                             "PROJECT/REPOSITORY/IMAGE[:TAG])")
        repository, image, tag = parsed
        if repository not in self.repositories:
            raise ValueError(f"name unknown: Repository \"{repository.rsplit('/', 1)[-1]}\" not found")
        versions = self.images[repository]
        stored = versions.get((image, digest))
        if stored is None:
            stored = versions[(image, digest)] = StoredImage(repository, image, digest, entry, size)
        stored.entry = entry
        if tag:
            for other in versions.values():  # a tag names one version of its image
                if other.image == image and tag in other.tags and other is not stored:
                    other.tags.discard(tag)
            stored.tags.add(tag)
        for reference in stored.references():
            self.table.add(reference, entry)
        return stored

    def _forget(self, stored: StoredImage) -> None:
        for reference in stored.references():
            self.table.remove(reference)
        self.images[stored.repository].pop((stored.image, stored.digest), None)

    def _stored(self, repository: str, image: Optional[str] = None) -> list:
        self.repository(repository)
        items = [s for s in self.images[repository].values() if image is None or s.image == image]
        return sorted(items, key=lambda s: (s.upload_time, s.digest))

    def _version(self, name: str) -> StoredImage:
        repository, image, digest = _split(name, "version", r"packages/([^/]+)/versions/(sha256:[0-9a-f]{64})")
        for stored in self._stored(repository, image):
            if stored.digest == digest:
                return stored
        raise NotFound(f"Requested entity was not found: version '{name}'.")

    def list_docker_images(self, backend, r: ar.ListDockerImagesRequest) -> ar.ListDockerImagesResponse:
        page, token = paginate(self._stored(r.parent), r.page_size, r.page_token)
        return ar.ListDockerImagesResponse(docker_images=[s.docker_image() for s in page], next_page_token=token)

    def get_docker_image(self, backend, r: ar.GetDockerImageRequest) -> ar.DockerImage:
        repository, image, digest = _split(r.name, "Docker image", r"dockerImages/([^/@]+)@(sha256:[0-9a-f]{64})")
        version = f"{repository}/packages/{quote(image, safe='')}/versions/{digest}"
        return self._version(version).docker_image()

    def _packages(self, repository: str) -> list:
        names: dict = {}
        for stored in self._stored(repository):
            names.setdefault(stored.image, stored)
        return [ar.Package(name=s.package_name, display_name=image, create_time=s.upload_time,
                           update_time=s.upload_time) for image, s in sorted(names.items())]

    def list_packages(self, backend, r: ar.ListPackagesRequest) -> ar.ListPackagesResponse:
        page, token = paginate(self._packages(r.parent), r.page_size, r.page_token)
        return ar.ListPackagesResponse(packages=page, next_page_token=token)

    def get_package(self, backend, r: ar.GetPackageRequest) -> ar.Package:
        repository, _, _ = _split(r.name, "package", r"packages/([^/]+)")
        for package in self._packages(repository):
            if package.name == r.name:
                return package
        raise NotFound(f"Requested entity was not found: package '{r.name}'.")

    def delete_package(self, backend, r: ar.DeletePackageRequest):
        repository, image, _ = _split(r.name, "package", r"packages/([^/]+)")
        stored = self._stored(repository, image)
        if not stored:
            raise NotFound(f"Requested entity was not found: package '{r.name}'.")
        for version in stored:
            self._forget(version)
        return service_operations.start(backend, ar.OperationMetadata, empty_pb2.Empty).to_pb()

    def list_versions(self, backend, r: ar.ListVersionsRequest) -> ar.ListVersionsResponse:
        repository, image, _ = _split(r.parent, "package", r"packages/([^/]+)")
        page, token = paginate(self._stored(repository, image), r.page_size, r.page_token)
        return ar.ListVersionsResponse(versions=[s.version() for s in page], next_page_token=token)

    def get_version(self, backend, r: ar.GetVersionRequest) -> ar.Version:
        return self._version(r.name).version()

    def delete_version(self, backend, r: ar.DeleteVersionRequest):
        stored = self._version(r.name)
        if stored.tags and not r.force:
            raise FailedPrecondition(f"Version {r.name} has tags ({', '.join(sorted(stored.tags))}): "
                                     "delete them first or set force to delete the version with its tags.")
        self._forget(stored)
        return service_operations.start(backend, ar.OperationMetadata, empty_pb2.Empty).to_pb()

    def list_tags(self, backend, r: ar.ListTagsRequest) -> ar.ListTagsResponse:
        repository, image, _ = _split(r.parent, "package", r"packages/([^/]+)")
        tags = [tag for s in self._stored(repository, image) for tag in s.version().related_tags]
        page, token = paginate(sorted(tags, key=lambda t: t.name), r.page_size, r.page_token)
        return ar.ListTagsResponse(tags=page, next_page_token=token)

    def _tag(self, name: str) -> tuple:
        """:return: ``(StoredImage, tag)`` of a tag name. :raises NotFound: no such tag."""
        repository, image, tag = _split(name, "tag", r"packages/([^/]+)/tags/([^/]+)")
        for stored in self._stored(repository, image):
            if tag in stored.tags:
                return stored, tag
        raise NotFound(f"Requested entity was not found: tag '{name}'.")

    def get_tag(self, backend, r: ar.GetTagRequest) -> ar.Tag:
        stored, tag = self._tag(r.name)
        return ar.Tag(name=r.name, version=f"{stored.package_name}/versions/{stored.digest}")

    def delete_tag(self, backend, r: ar.DeleteTagRequest) -> empty_pb2.Empty:
        """Remove the tag (and its ``...:TAG`` image reference); the version stays, as Google's does."""
        stored, tag = self._tag(r.name)
        self.table.remove(f"{stored.host_path}:{tag}")
        stored.tags.discard(tag)
        return empty_pb2.Empty()

    def reset(self) -> None:
        """Forget every repository and the images pushed to it, their references in the image
        table included (the table file's own entries stay)."""
        for versions in self.images.values():
            for stored in list(versions.values()):
                self._forget(stored)
        self.repositories.clear()
        self.images.clear()

    def rpcs(self) -> list:
        """The served methods, as :class:`~.rpcs.Rpc` entries bound to this service."""
        def rpc(method, request, handler, mutating=False, resource="name"):
            return Rpc(SERVICE, method, request, handler, mutating=mutating, resource=resource)

        return [
            rpc("CreateRepository", ar.CreateRepositoryRequest, self.create_repository, True, "parent"),
            rpc("GetRepository", ar.GetRepositoryRequest, lambda b, r: self.repository(r.name)),
            rpc("ListRepositories", ar.ListRepositoriesRequest, self.list_repositories, resource="parent"),
            rpc("DeleteRepository", ar.DeleteRepositoryRequest, self.delete_repository, True),
            rpc("ListDockerImages", ar.ListDockerImagesRequest, self.list_docker_images, resource="parent"),
            rpc("GetDockerImage", ar.GetDockerImageRequest, self.get_docker_image),
            rpc("ListPackages", ar.ListPackagesRequest, self.list_packages, resource="parent"),
            rpc("GetPackage", ar.GetPackageRequest, self.get_package),
            rpc("DeletePackage", ar.DeletePackageRequest, self.delete_package, True),
            rpc("ListVersions", ar.ListVersionsRequest, self.list_versions, resource="parent"),
            rpc("GetVersion", ar.GetVersionRequest, self.get_version),
            rpc("DeleteVersion", ar.DeleteVersionRequest, self.delete_version, True),
            rpc("ListTags", ar.ListTagsRequest, self.list_tags, resource="parent"),
            rpc("GetTag", ar.GetTagRequest, self.get_tag),
            rpc("DeleteTag", ar.DeleteTagRequest, self.delete_tag, True),
        ]
