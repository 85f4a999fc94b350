"""How :class:`~airflow_gpu_resilience.hooks.cloud_run.CloudRunGpuHook` builds its Cloud Run clients.

Where the calls go, first match wins:

1. ``CLOUD_RUN_EMULATOR_HOST`` (``host:port`` of a Cloud Run emulator's gRPC server, named after
   Google's ``PUBSUB_EMULATOR_HOST`` and its kin): gRPC on an insecure channel with anonymous
   credentials and no code change; the connection's endpoint, transport and credentials are not
   used, and its ``project`` extra is the only field read (the connection must exist, since
   ``GoogleBaseHook`` reads it when the hook is made, but it needs no extra). The
   hook logs once, at its first client, that the emulator is used.
2. The Airflow connection: a ``google_cloud_platform`` connection whose extra holds
   ``api_endpoint`` (for example ``http://127.0.0.1:8123``, the emulator's REST server) sends
   every call there; an ``http://`` endpoint implies the REST transport, the only one that
   speaks plain HTTP.
3. Google's endpoint, on the clients' default transport (gRPC).

In 2 and 3 credentials and client options come from ``GoogleBaseHook`` (the connection's key,
ADC or ``is_anonymous``, which the emulator needs).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any, TypeVar

import grpc
from google.auth.credentials import AnonymousCredentials
from google.cloud import run_v2

from airflow.providers.google.common.consts import CLIENT_INFO

#: Names the Cloud Run emulator's gRPC server, ``host:port`` (its ready line's ``grpcEndpoint``).
EMULATOR_HOST_ENV = "CLOUD_RUN_EMULATOR_HOST"
_HOST_PORT = re.compile(r"^(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):[0-9]{1,5}$")

_Client = TypeVar("_Client")


def emulator_host(environ: Mapping[str, str] = os.environ) -> str | None:
    """The Cloud Run emulator's gRPC address from ``CLOUD_RUN_EMULATOR_HOST``, or ``None``.

    :param environ: the environment to read (default ``os.environ``).
    :return: ``host:port`` (surrounding spaces removed), or ``None`` when unset or empty.
    :raises ValueError: naming the variable and its value, when it is not ``host:port`` with a
        port from 1 to 65535 (a URL such as ``http://127.0.0.1:8124`` included: gRPC takes no scheme).
    """
    value = environ.get(EMULATOR_HOST_ENV, "").strip()
    if not value:
        return None
    if not _HOST_PORT.match(value) or not 0 < int(value.rsplit(":", 1)[1]) < 65536:
        raise ValueError(f"{EMULATOR_HOST_ENV}={value!r}: give host:port of the Cloud Run emulator's gRPC server "
                         "(its ready line's grpcEndpoint), e.g. 127.0.0.1:8124, without a scheme; or unset it")
    return value


class CloudRunClientsMixin:
    """The client part of ``CloudRunGpuHook`` (a ``GoogleBaseHook``): endpoint, transport,
    credentials, and the Jobs, Executions and Tasks clients, cached per (kind, location).

    The hook's ``__init__`` sets ``_api_endpoint``, ``_transport``, ``_clients`` (``{}``) and
    ``_emulator_channel`` (``None``).
    """

    @property
    def api_endpoint(self) -> str | None:
        """The endpoint override: the constructor argument, else the connection extra, else ``None``."""
        return self._api_endpoint or self._get_field("api_endpoint") or None

    @property
    def transport(self) -> str | None:
        """The transport in use: ``"grpc"`` under ``CLOUD_RUN_EMULATOR_HOST``, else the explicit
        one, else ``"rest"`` for an ``http://`` endpoint, else ``None``."""
        if emulator_host():
            return "grpc"
        if self._transport:
            return self._transport
        endpoint = self.api_endpoint or ""
        return "rest" if endpoint.startswith("http://") else None

    def get_credentials_and_project_id(self) -> tuple:
        """Under ``CLOUD_RUN_EMULATOR_HOST``: anonymous credentials and the connection's
        ``project`` extra (``None`` without one); else ``GoogleBaseHook``'s."""
        if emulator_host() is None:
            return super().get_credentials_and_project_id()
        return AnonymousCredentials(), self._get_field("project") or None

    def _client(self, kind: type[_Client], location: str) -> _Client:
        key = (kind, location)
        if key not in self._clients:
            host = emulator_host()
            if host:
                self._clients[key] = self._emulator_client(kind, host)
                return self._clients[key]
            kwargs: dict[str, Any] = {
                "credentials": self.get_credentials(),
                "client_info": CLIENT_INFO,
                "client_options": self.get_client_options(self.api_endpoint),
            }
            if self.transport:
                kwargs["transport"] = self.transport
            self._clients[key] = kind(**kwargs)
        return self._clients[key]

    def _emulator_client(self, kind: type[_Client], host: str) -> _Client:
        """``kind`` on gRPC to the emulator at ``host``: one insecure channel per hook (a channel
        carries no credentials), logged at its opening."""
        if self._emulator_channel is None:
            self.log.info("Cloud Run API: the emulator at %s (%s), over gRPC on an insecure channel with anonymous "
                          "credentials; the connection's endpoint and credentials are not used", host, EMULATOR_HOST_ENV)
            self._emulator_channel = grpc.insecure_channel(host)
        transport_class = kind.get_transport_class("grpc")
        return kind(transport=transport_class(channel=self._emulator_channel, client_info=CLIENT_INFO))

    def jobs_client(self, location: str) -> run_v2.JobsClient:
        """The Jobs client for ``location`` (cached per location).

        :param location: Cloud Run region, e.g. ``us-central1``.
        """
        return self._client(run_v2.JobsClient, location)

    def executions_client(self, location: str) -> run_v2.ExecutionsClient:
        """The Executions client for ``location`` (cached per location).

        :param location: Cloud Run region.
        """
        return self._client(run_v2.ExecutionsClient, location)

    def tasks_client(self, location: str) -> run_v2.TasksClient:
        """The Tasks client for ``location`` (cached per location).

        :param location: Cloud Run region.
        """
        return self._client(run_v2.TasksClient, location)
