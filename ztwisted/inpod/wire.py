"""Encode and decode the ZDS messages (one protobuf message per datagram).

Decoding validates what zds.md requires and raises :class:`ZdsProtocolError`
(never anything else) for bytes that are not a usable message. Requests are
plain attrs values, so nothing outside this module touches protobuf.
"""

from __future__ import annotations

from typing import ClassVar

import attrs
from google.protobuf.message import Message

from ztwisted.inpod import zds_pb2

VERSION_NOT_USED = zds_pb2.NOT_USED
VERSION_V1 = zds_pb2.V1


class ZdsProtocolError(Exception):
    """A peer broke the ZDS protocol.

    ``reason`` is a short slug (a metric label: ``decode_error``,
    ``missing_fd``...); ``message`` is the text for logs and error Acks.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message

    def __repr__(self) -> str:
        return f"ZdsProtocolError({self.reason!r}, {self.message!r})"


@attrs.frozen
class WorkloadInfo:
    """Who the pod is: its name, Kubernetes namespace and service account."""

    name: str
    namespace: str
    service_account: str


@attrs.frozen
class AddWorkload:
    kind: ClassVar[str] = "add"
    uid: str
    workload_info: WorkloadInfo


@attrs.frozen
class KeepWorkload:
    kind: ClassVar[str] = "keep"
    uid: str


@attrs.frozen
class DelWorkload:
    kind: ClassVar[str] = "del"
    uid: str


@attrs.frozen
class SnapshotSent:
    kind: ClassVar[str] = "snapshot_sent"


@attrs.frozen
class ShutdownStarting:
    """The ztwisted extension (oneof field 1191): the pod began terminating."""

    kind: ClassVar[str] = "shutdown_starting"
    uid: str


Request = AddWorkload | KeepWorkload | DelWorkload | SnapshotSent | ShutdownStarting


@attrs.frozen
class Ack:
    """An agent-side view of a WorkloadResponse: empty ``error`` means success."""

    error: str = ""

    @property
    def ok(self) -> bool:
        return self.error == ""


# -- encoding ----------------------------------------------------------------


def encode_hello(version: int = VERSION_V1) -> bytes:
    return zds_pb2.ZdsHello(version=version).SerializeToString()


def encode_ack(error: str = "") -> bytes:
    """A ``WorkloadResponse{ack: Ack{error}}``; ``b"\\x0a\\x00"`` for success."""
    return zds_pb2.WorkloadResponse(ack=zds_pb2.Ack(error=error)).SerializeToString()


def encode_request(request: Request) -> bytes:
    message = zds_pb2.WorkloadRequest()
    if isinstance(request, AddWorkload):
        info = request.workload_info
        message.add.uid = request.uid
        message.add.workload_info.name = info.name
        message.add.workload_info.namespace = info.namespace
        message.add.workload_info.service_account = info.service_account
        # An all-empty WorkloadInfo serializes to nothing; mark it present.
        message.add.workload_info.SetInParent()
    elif isinstance(request, KeepWorkload):
        message.keep.uid = request.uid
    elif isinstance(request, DelWorkload):
        getattr(message, "del").uid = request.uid  # "del" is a Python keyword
    elif isinstance(request, SnapshotSent):
        message.snapshot_sent.SetInParent()
    elif isinstance(request, ShutdownStarting):
        message.shutdown_starting.uid = request.uid
    else:
        raise TypeError(f"not a ZDS request: {request!r}")
    return message.SerializeToString()


# -- decoding ----------------------------------------------------------------


def _parse(message: Message, data: bytes) -> Message:
    name = message.DESCRIPTOR.name
    try:
        message.ParseFromString(bytes(data))
    except Exception as exc:  # DecodeError, and anything odd the parser may raise on garbage
        raise ZdsProtocolError(
            "decode_error", f"cannot decode {name} from {len(data)} bytes: {exc or type(exc).__name__}"
        ) from exc
    return message


def _unknown_field_numbers(message: Message) -> list[int]:
    try:
        from google.protobuf.unknown_fields import UnknownFieldSet
    except ImportError:  # protobuf < 4.22: no way to list them
        return []
    return sorted({field.field_number for field in UnknownFieldSet(message)})


def _no_payload(message: Message) -> ZdsProtocolError:
    name = message.DESCRIPTOR.name
    unknown = _unknown_field_numbers(message)
    if unknown:
        numbers = ", ".join(str(n) for n in unknown)
        return ZdsProtocolError(
            "unknown_message", f"{name} carries no payload this peer knows (unknown field number {numbers})"
        )
    return ZdsProtocolError("empty_message", f"{name} has no payload (empty oneof)")


def _uid(kind: str, uid: str) -> str:
    if not uid:
        raise ZdsProtocolError("missing_uid", f"{kind} request without a uid")
    return uid


def decode_request(data: bytes) -> Request:
    """One WorkloadRequest datagram as a :data:`Request`."""
    message = _parse(zds_pb2.WorkloadRequest(), data)
    which = message.WhichOneof("payload")
    if which is None:
        raise _no_payload(message)
    if which == "add":
        add = message.add
        uid = _uid("add", add.uid)
        if not add.HasField("workload_info"):
            raise ZdsProtocolError("missing_workload_info", f"add request for uid {uid!r} without workload_info")
        info = add.workload_info
        return AddWorkload(uid, WorkloadInfo(info.name, info.namespace, info.service_account))
    if which == "keep":
        return KeepWorkload(_uid("keep", message.keep.uid))
    if which == "del":
        return DelWorkload(_uid("del", getattr(message, "del").uid))
    if which == "snapshot_sent":
        return SnapshotSent()
    if which == "shutdown_starting":
        return ShutdownStarting(_uid("shutdown_starting", message.shutdown_starting.uid))
    raise ZdsProtocolError("unknown_message", f"WorkloadRequest payload {which!r} is not handled")


def decode_response(data: bytes) -> Ack:
    """One WorkloadResponse datagram (what the agent reads) as an :class:`Ack`."""
    message = _parse(zds_pb2.WorkloadResponse(), data)
    if message.WhichOneof("payload") != "ack":
        raise _no_payload(message)
    return Ack(message.ack.error)


def decode_hello(data: bytes) -> int:
    """The version a proxy announced; a hello without one (NOT_USED) is an error."""
    message = _parse(zds_pb2.ZdsHello(), data)
    if message.version == VERSION_NOT_USED:
        raise ZdsProtocolError("bad_hello", "ZdsHello without a version (NOT_USED)")
    return message.version
