"""The delta xDS client (ADS), as ztunnel speaks it to istiod.

One gRPC stream, ``DeltaAggregatedResources``, subscribed (wildcard) to
workloads and services (``istio.workload.Address``) and policies
(``istio.security.Authorization``). Each response is applied to the
accepted state and answered: an ACK carries its nonce, a NACK also an
``error_detail`` naming every rejected resource; rejected resources keep
their previous version. The stream ends, the client reconnects after a
jittered exponential backoff and resumes with the versions it holds; the
last good state serves traffic meanwhile. Readiness waits until each type
has been ACKed once.
"""

from __future__ import annotations

import random as random_module
from collections.abc import Callable

import attrs
from google.protobuf import message as protobuf_message
from google.protobuf import struct_pb2
from twisted.application import service
from twisted.internet import defer
from twisted.logger import Logger
from twisted.python.failure import Failure

from ztwisted.model import Mesh, Policy, Service, Workload, unique_key
from ztwisted.xds import authorization_pb2, discovery_pb2, grpc, workload_pb2
from ztwisted.xds.resources import (
    ADDRESS_TYPE,
    AUTHORIZATION_TYPE,
    InvalidResource,
    address_from_proto,
    policy_from_proto,
)

log = Logger()

ADS_METHOD = "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources"
#: ztunnel's backoff bounds
INITIAL_BACKOFF = 0.01
MAX_BACKOFF = 15.0

_DECODERS = {
    ADDRESS_TYPE: (workload_pb2.Address, address_from_proto),
    AUTHORIZATION_TYPE: (authorization_pb2.Authorization, policy_from_proto),
}


@attrs.frozen
class NodeInfo:
    """What the proxy says about itself in every initial request (ztunnel's ``Node``)."""

    instance_ip: str = "1.1.1.1"
    pod_name: str = ""
    pod_namespace: str = ""
    node_name: str = ""
    #: ISTIO_META_* values (prefix removed), e.g. CLUSTER_ID
    metadata: dict = attrs.field(factory=dict)

    def to_proto(self) -> discovery_pb2.Node:
        fields = struct_pb2.Struct()
        fields.update(
            {
                "NAME": self.pod_name,
                "NAMESPACE": self.pod_namespace,
                "INSTANCE_IPS": self.instance_ip,
                "NODE_NAME": self.node_name,
                **self.metadata,
            }
        )
        ns = self.pod_namespace
        return discovery_pb2.Node(
            id=f"ztunnel~{self.instance_ip}~{self.pod_name}.{ns}~{ns}.svc.cluster.local", metadata=fields
        )


def _by_type() -> dict[str, dict]:
    """An empty entry for each subscribed type."""
    return {type_url: {} for type_url in _DECODERS}


@attrs.define(eq=False)
class XdsState:
    """The accepted resources of each type, by name, and their versions."""

    resources: dict[str, dict[str, Workload | Service | Policy]] = attrs.field(factory=_by_type)
    versions: dict[str, dict[str, str]] = attrs.field(factory=_by_type)

    def mesh(self) -> Mesh:
        return _mesh_of(self.resources)

    def apply(self, response: discovery_pb2.DeltaDiscoveryResponse) -> tuple[Mesh | None, list[str]]:
        """Apply what is valid; returns the new mesh (None if nothing changed) and the rejections."""
        type_url = response.type_url
        if type_url not in _DECODERS:
            return None, [f"type {type_url!r} is not one ztwisted subscribed to"]
        message_class, convert = _DECODERS[type_url]
        candidate = {t: dict(by_name) for t, by_name in self.resources.items()}
        versions = dict(self.versions[type_url])
        for name in response.removed_resources:
            candidate[type_url].pop(name, None)
            versions.pop(name, None)
        claims = _Claims(candidate)
        rejected = []
        for resource in response.resources:
            try:
                if resource.resource.type_url != type_url:
                    raise InvalidResource(f"{resource.name}: carries {resource.resource.type_url!r}, not {type_url!r}")
                decoded = message_class()
                try:
                    resource.resource.Unpack(decoded)
                except protobuf_message.DecodeError as e:
                    raise InvalidResource(
                        f"{resource.name}: not a valid {message_class.DESCRIPTOR.full_name}: {e}"
                    ) from None
                converted = convert(decoded, resource.name)
                # A uid or key another accepted resource holds: this one is rejected, the other stays.
                claims.take(resource.name, converted, candidate[type_url].get(resource.name))
                candidate[type_url][resource.name] = converted
                versions[resource.name] = resource.version
            except (InvalidResource, ValueError) as e:
                rejected.append(str(e))
        try:
            mesh = _mesh_of(candidate)
        except ValueError as e:  # not expected after the claims: keep everything as it was
            return None, [*rejected, f"the update conflicts with the accepted state: {e}"]
        changed = candidate != self.resources
        self.resources = candidate
        self.versions[type_url] = versions
        return (mesh if changed else None), rejected


class _Claims:
    """Who holds each uid and key the model wants unique (:func:`ztwisted.model.unique_key`), by resource name.

    Addresses are not claimed: as in ztunnel and the local config, workloads
    may share one and services of different namespaces a VIP.
    """

    def __init__(self, resources) -> None:
        self._holder: dict[tuple[str, str], str] = {
            unique_key(resource): name for by_name in resources.values() for name, resource in by_name.items()
        }

    def take(self, name: str, new, old) -> None:
        """Move ``name``'s claim from ``old`` to ``new``; InvalidResource if another resource holds it."""
        claim = unique_key(new)
        holder = self._holder.get(claim, name)
        if holder != name:
            kind, value = claim
            raise InvalidResource(f"{name}: {kind} {value!r} is already {holder}'s")
        if old is not None and self._holder.get(unique_key(old)) == name:
            del self._holder[unique_key(old)]
        self._holder[claim] = name


def _mesh_of(resources) -> Mesh:
    addresses = sorted(resources[ADDRESS_TYPE].items())
    return Mesh(
        workloads=[r for _, r in addresses if isinstance(r, Workload)],
        services=[r for _, r in addresses if isinstance(r, Service)],
        policies=[r for _, r in sorted(resources[AUTHORIZATION_TYPE].items())],
    )


class XdsClient(service.Service):
    """Keeps one ADS stream to ``target`` open and feeds accepted meshes to ``on_mesh``."""

    def __init__(
        self,
        reactor,
        target: grpc.Target,
        *,
        node: NodeInfo,
        on_mesh: Callable[[Mesh], None],
        headers: Callable[[], list[tuple[str, str]]] = list,
        random: random_module.Random | None = None,
        connect_timeout: float = 5.0,
        metrics=None,
    ):
        self.reactor = reactor
        self.target = target
        self.node = node
        self.on_mesh = on_mesh
        self.headers = headers
        self.random = random or random_module.Random()
        self.connect_timeout = connect_timeout
        self.state = XdsState()
        self.metrics = XdsMetrics(metrics) if metrics is not None else None
        self._awaiting = set(_DECODERS)
        #: fires once every type has been ACKed (the first full push)
        self.first_push = defer.Deferred()
        self._backoff = INITIAL_BACKOFF
        self._retry = None
        self._connection: grpc.GrpcConnection | None = None
        self._call: grpc.GrpcCall | None = None
        self._received_on_stream = False
        self.connected = False
        self.streams_opened = 0
        self.acks = 0
        self.nacks = 0
        self.last_nack: str | None = None
        self.last_error: str | None = None

    # -- lifecycle ---------------------------------------------------------------

    def startService(self) -> None:
        super().startService()
        self._connect()

    def stopService(self):
        super().stopService()
        if self._retry is not None and self._retry.active():
            self._retry.cancel()
        if self._call is not None:
            self._call.cancel()
        if self._connection is not None:
            return self._connection.drain(graceful=False)
        return None

    def ready(self) -> bool:
        return not self._awaiting

    def pending(self) -> list[str]:
        return [f"xDS {t.rsplit('/', 1)[-1]}" for t in sorted(self._awaiting)]

    def status(self) -> dict:
        return {
            "address": f"https://{self.target.authority}",
            "connected": self.connected,
            "streams_opened": self.streams_opened,
            "awaiting_first_push": sorted(self._awaiting),
            "acks": self.acks,
            "nacks": self.nacks,
            "last_nack": self.last_nack,
            "last_error": self.last_error,
            "resources": {t: dict(sorted(v.items())) for t, v in self.state.versions.items()},
        }

    # -- the stream ----------------------------------------------------------------

    def _connect(self) -> None:
        self._retry = None
        if not self.running:
            return
        connecting = grpc.connect(self.reactor, self.target, timeout=self.connect_timeout)
        connecting.addCallbacks(self._open_stream, self._ended)

    def _open_stream(self, connection: grpc.GrpcConnection) -> None:
        if not self.running:
            connection.drain(graceful=False)
            return
        self._connection = connection
        try:
            metadata = self.headers()
        except OSError as e:
            connection.drain(graceful=False)
            self._ended(Failure(e))
            return
        call = connection.call(ADS_METHOD, metadata, self._message)
        self._call = call
        self._received_on_stream = False
        self.streams_opened += 1
        self.connected = True
        log.info("xDS stream open to {address}", address=f"https://{self.target.authority}")
        node = self.node.to_proto()
        for type_url in sorted(_DECODERS):
            # Resume: tell the server which versions this proxy holds already.
            call.send(
                discovery_pb2.DeltaDiscoveryRequest(
                    node=node,
                    type_url=type_url,
                    initial_resource_versions=self.state.versions[type_url],
                ).SerializeToString()
            )
        call.done.addBoth(self._ended)

    def _message(self, data: bytes) -> None:
        response = discovery_pb2.DeltaDiscoveryResponse.FromString(data)
        self._received_on_stream = True
        if self.metrics is not None:
            self.metrics.received(response)
        mesh, rejected = self.state.apply(response)
        request = discovery_pb2.DeltaDiscoveryRequest(type_url=response.type_url, response_nonce=response.nonce)
        if rejected:
            error = "; ".join(rejected)
            request.error_detail.CopyFrom(discovery_pb2.Status(code=grpc.INVALID_ARGUMENT, message=error))
            self.nacks += 1
            self.last_nack = error
            if self.metrics is not None:
                self.metrics.nacks.labels(url=response.type_url).inc()
            log.error(
                "xDS: NACK {type_url} (nonce {nonce}), keeping the last good version of: {error}",
                type_url=response.type_url,
                nonce=response.nonce,
                error=error,
            )
        else:
            self.acks += 1
            self._awaiting.discard(response.type_url)
        self._call.send(request.SerializeToString())
        if mesh is not None:
            self.on_mesh(mesh)
        if not self._awaiting and not self.first_push.called:
            applied = self.state.mesh()
            log.info(
                "xDS: first push applied ({workloads} workloads, {policies} policies)",
                workloads=len(applied.workloads),
                policies=len(applied.policies),
            )
            self.first_push.callback(None)

    def _ended(self, result) -> None:
        self.connected = False
        self._call = None
        if self._connection is not None:
            self._connection.drain(graceful=False)
            self._connection = None
        if not self.running:
            return
        reason = getattr(result, "value", None)
        self.last_error = str(reason) if reason is not None else "the server ended the stream"
        if self.metrics is not None:
            self.metrics.terminations.labels(reason=_termination_reason(reason)).inc()
        if self._received_on_stream or (
            isinstance(reason, grpc.GrpcError) and reason.code in (grpc.OK, grpc.CANCELLED)
        ):
            self._backoff = INITIAL_BACKOFF
        else:
            self._backoff = min(MAX_BACKOFF, self._backoff * 2)
        # Equal jitter: many proxies that lost the same control plane do not return in step.
        delay = self._backoff / 2 + self.random.uniform(0, self._backoff / 2)
        log.warn(
            "xDS stream to {address} ended: {reason}; reconnecting in {delay:.2f} s, serving the last good state "
            "({workloads} workloads, {services} services, {policies} policies)",
            address=f"https://{self.target.authority}",
            reason=self.last_error,
            delay=delay,
            workloads=sum(isinstance(r, Workload) for r in self.state.resources[ADDRESS_TYPE].values()),
            services=sum(isinstance(r, Service) for r in self.state.resources[ADDRESS_TYPE].values()),
            policies=len(self.state.resources[AUTHORIZATION_TYPE]),
        )
        self._retry = self.reactor.callLater(delay, self._connect)


def _termination_reason(error) -> str:
    """ztunnel's reasons: the connection failed, the server ended the stream (cleanly or asking for a reconnect), or else."""
    if error is None or (isinstance(error, grpc.GrpcError) and error.code == grpc.OK):
        return "Complete"
    if not isinstance(error, grpc.GrpcError):
        return "ConnectionError"
    if error.code in (grpc.UNKNOWN, grpc.CANCELLED, grpc.DEADLINE_EXCEEDED):
        return "Reconnect"
    return "Error"


class XdsMetrics:
    """ztunnel's istio_xds_* metrics (and NACKs) on the node's registry."""

    def __init__(self, metrics):
        self.terminations = metrics.counter(
            "istio_xds_connection_terminations_total",
            "The total number of completed connections to xds server",
            ("reason",),
        )
        self.messages = metrics.counter("istio_xds_message_total", "Total number of messages received", ("url",))
        self.message_bytes = metrics.counter(
            "istio_xds_message_bytes_total", "Total number of bytes received", ("url",)
        )
        self.nacks = metrics.counter("ztwisted_xds_nacks_total", "Responses rejected (NACKed), by type", ("url",))

    def received(self, response) -> None:
        self.messages.labels(url=response.type_url).inc()
        self.message_bytes.labels(url=response.type_url).inc(sum(len(r.resource.value) for r in response.resources))
