"""Long-running operations of the other emulated APIs (Cloud Build, Artifact Registry).

Their clients poll an operation with ``google.longrunning.Operations`` on the same endpoint, as
the Cloud Run clients do, and a gRPC server can serve that service once: so their operations are
kept where Cloud Run's are, in the operations of the :class:`~.backend.CloudRunBackend` of their
project and location (``projects/P/locations/L/operations/ID``), and GetOperation,
WaitOperation, ListOperations and DeleteOperation (:mod:`.rpcs`) serve all of them alike. What
differs is only what they carry: an :class:`ApiOperation` packs its own metadata and response
messages instead of one resource's view.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Callable, Optional

from google.longrunning import operations_pb2
from google.protobuf import any_pb2
from google.rpc import status_pb2

from .models import Operation


def _plain(message):
    """The protobuf message of a proto-plus or protobuf message."""
    return message if hasattr(message, "SerializeToString") else type(message).pb(message)


@dataclasses.dataclass
class ApiOperation(Operation):
    """An operation whose metadata and response are given as functions (read at each poll).

    :param metadata: ``() -> message``, the operation's metadata now.
    :param response: ``() -> message``, its response once done (``None``: none is set).
    """

    metadata: Optional[Callable] = None
    response: Optional[Callable] = None

    def to_pb(self) -> operations_pb2.Operation:
        op = operations_pb2.Operation(name=self.name, done=self.done)
        if self.metadata is not None:
            op.metadata.Pack(_plain(self.metadata()))
        if self.done and self.error:
            op.error.CopyFrom(status_pb2.Status(code=self.error[0], message=self.error[1]))
        elif self.done and self.response is not None:
            packed = any_pb2.Any()
            packed.Pack(_plain(self.response()))
            op.response.CopyFrom(packed)
        return op


def start(backend, metadata: Callable, response: Optional[Callable] = None, done: bool = True) -> ApiOperation:
    """A new operation kept in ``backend``'s operations (the caller holds the registry's lock).

    :param backend: the :class:`~.backend.CloudRunBackend` of the request's project and location.
    :param metadata: see :class:`ApiOperation`.
    :param response: see :class:`ApiOperation`.
    :param done: whether it is done already (the call did all its work).
    :return: the operation.
    """
    op = ApiOperation(name=f"{backend.parent}/operations/{uuid.uuid4()}", target=None, done=done,
                      metadata=metadata, response=response)
    backend.operations[op.name] = op
    return op
