"""``ztunnel-agent``: the node-agent side of ZDS, for tests, demos and the drain lab.

``ztunnel-agent serve --socket PATH`` listens on a SEQPACKET socket like
istio-cni's node agent and follows its rules: the proxy's hello within 5 s
(else the connection is dropped); one request at a time per proxy, each
waiting up to ``--ack-timeout`` for its Ack; the snapshot (an Add per pod
with a netns, a Keep per pod without, then SnapshotSent) to every newly
connected proxy; Adds only to the newest proxy; Dels (and ShutdownStarting)
to every connected one. A small JSON HTTP API (``--control``) drives it,
and the other subcommands call that API and print each Ack as JSON::

    ztunnel-agent add --uid U --name N --namespace NS --service-account SA --netns /var/run/netns/NAME
    ztunnel-agent keep|delete|shutdown-starting --uid U
    ztunnel-agent snapshot-end      # with serve --manual-snapshot: end the snapshot by hand
    ztunnel-agent status

Unlike the real agent, an Ack that arrives after its timeout is recognised
as late (and shown by ``status``) instead of being taken for the next
request's Ack.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import sys
from collections import deque
from typing import Any
from urllib.parse import urlsplit

import attrs
from twisted.internet import defer
from twisted.internet.endpoints import serverFromString
from twisted.internet.protocol import Factory
from twisted.internet.testing import MemoryReactor
from twisted.logger import Logger
from twisted.python import usage
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Site

from ztwisted import __version__
from ztwisted.inpod import DEFAULT_SOCKET_PATH, wire
from ztwisted.inpod.seqpacket import SeqpacketConnection, SeqpacketListener
from ztwisted.netns import Netns

log = Logger(namespace="ztwisted.tools.agent")

DEFAULT_CONTROL = "tcp:15099:interface=127.0.0.1"
CONTROL_ENV = "ZTUNNEL_AGENT_CONTROL"
ACK_TIMEOUT = 5.0  # the real agent's read/write deadline
HELLO_TIMEOUT = 5.0
_LATE_ACKS_KEPT = 20


@attrs.define
class AckResult:
    """What became of one request sent to one proxy."""

    proxy: int
    request: str
    uid: str
    outcome: str  # "ok", "error", "timeout" or "disconnected"
    error: str = ""
    latency: float | None = None  # seconds from send to Ack

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"

    def to_json(self) -> dict[str, Any]:
        return {
            "proxy": self.proxy,
            "request": self.request,
            "uid": self.uid,
            "ok": self.ok,
            "outcome": self.outcome,
            "error": self.error,
            "latency_ms": None if self.latency is None else round(self.latency * 1000, 3),
        }


@attrs.define
class PodRecord:
    """A pod the agent knows; without a netns it is announced with Keep."""

    uid: str
    workload_info: wire.WorkloadInfo | None = None
    netns: Netns | None = None
    netns_path: str | None = None

    def to_json(self) -> dict[str, Any]:
        info = self.workload_info
        return {
            "uid": self.uid,
            "name": info.name if info else None,
            "namespace": info.namespace if info else None,
            "service_account": info.service_account if info else None,
            "netns": self.netns_path,
            "netns_inode": self.netns.inode if self.netns is not None else None,
        }


@attrs.define(eq=False)
class _Outgoing:
    request: wire.Request
    fd: int | None  # our own duplicate of the netns fd, closed once sent
    result: defer.Deferred
    sent_at: float = 0.0
    timer: Any = None
    snapshot: bool = False  # part of the snapshot sent after the hello

    @property
    def uid(self) -> str:
        return getattr(self.request, "uid", "")

    def close_fd(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class ProxyConnection:
    """One connected proxy: hello, snapshot, then one request at a time."""

    def __init__(self, agent: ZdsAgent, sock: socket.socket, number: int) -> None:
        self.agent = agent
        self.reactor = agent.reactor
        self.number = number
        self.connected_at = self.reactor.seconds()
        self.hello_version: int | None = None
        self.snapshot_complete = False
        self.late_acks: deque[dict[str, Any]] = deque(maxlen=_LATE_ACKS_KEPT)
        self._queue: deque[_Outgoing] = deque()
        self._outstanding: _Outgoing | None = None
        self._timed_out: deque[_Outgoing] = deque()  # Acks still owed after their timeout
        self.conn = SeqpacketConnection(self.reactor, sock, self, name=f"proxy#{number}")
        self._hello_timer = self.reactor.callLater(agent.hello_timeout, self._no_hello)
        self.conn.start()

    @property
    def connected(self) -> bool:
        return not self.conn.disconnected

    def status(self) -> dict[str, Any]:
        return {
            "id": self.number,
            "hello_version": self.hello_version,
            "snapshot_complete": self.snapshot_complete,
            "connected_for_s": round(self.reactor.seconds() - self.connected_at, 3),
            "busy": self._outstanding is not None,
            "queued": len(self._queue),
            "late_acks": list(self.late_acks),
        }

    # -- sending -----------------------------------------------------------

    def send(self, request: wire.Request, netns: Netns | None = None) -> defer.Deferred:
        """Queue ``request`` (with ``netns`` as its fd); fires with an :class:`AckResult`."""
        item = self._item(request, netns)
        if not self.connected:
            item.close_fd()
            item.result.callback(self._result(item, "disconnected", "the proxy is not connected"))
            return item.result
        self._queue.append(item)
        self._next()
        return item.result

    def _item(self, request: wire.Request, netns: Netns | None) -> _Outgoing:
        # Our own duplicate of the fd: the pod may be deleted before this is sent.
        return _Outgoing(request, os.dup(netns.fileno()) if netns is not None else None, defer.Deferred())

    def _next(self) -> None:
        # Nothing goes out before the hello: the snapshot must come first.
        if self._outstanding is not None or not self._queue or self.hello_version is None or not self.connected:
            return
        item = self._queue.popleft()
        self._outstanding = item
        item.sent_at = self.reactor.seconds()
        item.timer = self.reactor.callLater(self.agent.ack_timeout, self._ack_timed_out, item)
        try:
            self.conn.send(wire.encode_request(item.request), [item.fd] if item.fd is not None else [])
        finally:
            item.close_fd()

    def _result(self, item: _Outgoing, outcome: str, error: str = "", latency: float | None = None) -> AckResult:
        return AckResult(self.number, item.request.kind, item.uid, outcome, error, latency)

    def _finish(self, item: _Outgoing, result: AckResult) -> None:
        if item.timer is not None and item.timer.active():
            item.timer.cancel()
        item.timer = None
        if self._outstanding is item:
            self._outstanding = None
        level = log.info if result.ok else log.warn
        level(
            "proxy#{proxy}: {request} {uid} -> {outcome} {error} ({latency})",
            proxy=self.number,
            request=result.request,
            uid=result.uid,
            outcome=result.outcome,
            error=result.error,
            latency="-" if result.latency is None else f"{result.latency * 1000:.1f} ms",
        )
        if isinstance(item.request, wire.SnapshotSent) and result.outcome in ("ok", "error"):
            self.snapshot_complete = True
        item.result.callback(result)
        if item.snapshot and result.outcome == "timeout":
            # As the real agent: a snapshot that cannot be delivered ends the connection.
            log.warn("proxy#{proxy}: snapshot Ack timed out; dropping the connection", proxy=self.number)
            self.conn.abort()
            return
        self._next()

    def _ack_timed_out(self, item: _Outgoing) -> None:
        item.timer = None
        if self._outstanding is not item:
            return
        self._timed_out.append(item)
        self._finish(item, self._result(item, "timeout", f"no Ack within {self.agent.ack_timeout:g} s"))

    # -- snapshot ------------------------------------------------------------

    def queue_snapshot(self, pods: list[PodRecord], *, end: bool) -> None:
        """Queue the snapshot in front of anything queued while waiting for the hello."""
        items: list[_Outgoing] = []
        for pod in pods:
            if pod.netns is not None and pod.workload_info is not None:
                items.append(self._item(wire.AddWorkload(pod.uid, pod.workload_info), pod.netns))
            else:
                items.append(self._item(wire.KeepWorkload(pod.uid), None))
        if end:
            items.append(self._item(wire.SnapshotSent(), None))
        for item in items:
            item.snapshot = True
            item.result.addCallback(self.agent._snapshot_result)
        self._queue.extendleft(reversed(items))

    # -- ISeqpacketHandler -------------------------------------------------------

    def datagram_received(self, payload: bytes, fds: list[int], flags: int) -> None:
        for fd in fds:  # a proxy never sends fds
            os.close(fd)
        if self.hello_version is None:
            self._hello(payload)
            return
        try:
            ack = wire.decode_response(payload)
        except wire.ZdsProtocolError as err:
            log.error(
                "proxy#{proxy} sent an undecodable response ({error}); dropping it",
                proxy=self.number,
                error=err.message,
            )
            self.conn.abort()
            return
        now = self.reactor.seconds()
        if self._timed_out:
            late = self._timed_out.popleft()
            entry = {
                "request": late.request.kind,
                "uid": late.uid,
                "error": ack.error,
                "latency_ms": round((now - late.sent_at) * 1000, 3),
            }
            self.late_acks.append(entry)
            log.warn(
                "proxy#{proxy}: late Ack for {request} {uid} after {latency_ms} ms: {error!r}",
                proxy=self.number,
                **entry,
            )
            return
        item = self._outstanding
        if item is None:
            log.error("proxy#{proxy} sent an Ack nobody asked for; dropping it", proxy=self.number)
            self.conn.abort()
            return
        latency = now - item.sent_at
        self._finish(item, self._result(item, "ok" if ack.ok else "error", ack.error, latency))

    def _hello(self, payload: bytes) -> None:
        try:
            version = wire.decode_hello(payload)
        except wire.ZdsProtocolError as err:
            log.error("proxy#{proxy}: bad hello ({error}); dropping it", proxy=self.number, error=err.message)
            self.conn.abort()
            return
        if self._hello_timer.active():
            self._hello_timer.cancel()
        if version != wire.VERSION_V1:
            log.warn("proxy#{proxy} speaks ZDS version {version}, this agent V1", proxy=self.number, version=version)
        self.hello_version = version
        log.info("proxy#{proxy} said hello (version {version})", proxy=self.number, version=version)
        self.agent._hello_received(self)
        self._next()

    def _no_hello(self) -> None:
        log.warn(
            "proxy#{proxy} sent no hello within {timeout:g} s; dropping it",
            proxy=self.number,
            timeout=self.agent.hello_timeout,
        )
        self.conn.abort()

    def connection_lost(self, reason: Failure) -> None:
        if self._hello_timer.active():
            self._hello_timer.cancel()
        pending = ([self._outstanding] if self._outstanding is not None else []) + list(self._queue)
        self._outstanding = None
        self._queue.clear()
        for item in pending:
            item.close_fd()
            if item.timer is not None and item.timer.active():
                item.timer.cancel()
            item.result.callback(self._result(item, "disconnected", "the proxy disconnected"))
        self.agent._proxy_gone(self)


class ZdsAgent:
    """The node agent: pods it knows, connected proxies, the rules between them."""

    def __init__(
        self,
        reactor: Any,
        socket_path: str,
        *,
        ack_timeout: float = ACK_TIMEOUT,
        hello_timeout: float = HELLO_TIMEOUT,
        manual_snapshot: bool = False,
    ) -> None:
        self.reactor = reactor
        self.socket_path = str(socket_path)
        self.ack_timeout = ack_timeout
        self.hello_timeout = hello_timeout
        self.manual_snapshot = manual_snapshot
        self.pods: dict[str, PodRecord] = {}
        self.proxies: list[ProxyConnection] = []  # oldest first
        self._listener: SeqpacketListener | None = None
        self._connections = 0

    def start(self) -> None:
        directory = os.path.dirname(self.socket_path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        self._listener = SeqpacketListener(self.reactor, self.socket_path, self._accepted)
        log.info("node agent listening on {path}", path=self.socket_path)

    def stop(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for proxy in list(self.proxies):
            proxy.conn.abort()
        for pod in self.pods.values():
            if pod.netns is not None:
                pod.netns.close()
        self.pods.clear()

    @property
    def newest(self) -> ProxyConnection | None:
        return self.proxies[-1] if self.proxies else None

    # -- connections ---------------------------------------------------------

    def _accepted(self, sock: socket.socket) -> None:
        self._connections += 1
        proxy = ProxyConnection(self, sock, self._connections)
        self.proxies.append(proxy)
        log.info("proxy#{proxy} connected ({count} connected)", proxy=proxy.number, count=len(self.proxies))

    def _hello_received(self, proxy: ProxyConnection) -> None:
        proxy.queue_snapshot(list(self.pods.values()), end=not self.manual_snapshot)

    def _snapshot_result(self, result: AckResult) -> AckResult:
        if not result.ok:
            log.warn("snapshot {request} {uid} to proxy#{proxy}: {outcome} {error}", **result.to_json())
        return result

    def _proxy_gone(self, proxy: ProxyConnection) -> None:
        if proxy in self.proxies:
            self.proxies.remove(proxy)
        log.info("proxy#{proxy} disconnected ({count} connected)", proxy=proxy.number, count=len(self.proxies))

    # -- operations (each fires with the list of AckResults) ----------------------

    def _to_newest(self, request: wire.Request, netns: Netns | None = None) -> defer.Deferred:
        proxy = self.newest
        if proxy is None:
            return defer.succeed([])
        return proxy.send(request, netns).addCallback(lambda result: [result])

    def _to_all(self, request: wire.Request) -> defer.Deferred:
        sends = [proxy.send(request) for proxy in list(self.proxies)]
        return defer.gatherResults(sends, consumeErrors=True)

    def add_pod(self, uid: str, workload_info: wire.WorkloadInfo, netns_path: str) -> defer.Deferred:
        """Record the pod (its netns opened and checked now) and send Add to the newest proxy."""
        netns = Netns.open(netns_path)
        old = self.pods.get(uid)
        if old is not None and old.netns is not None:
            old.netns.close()
        self.pods[uid] = PodRecord(uid, workload_info, netns, str(netns_path))
        return self._to_newest(wire.AddWorkload(uid, workload_info), netns)

    def keep_pod(self, uid: str) -> defer.Deferred:
        """Record a pod without a netns and send Keep to the newest proxy (valid during a snapshot only)."""
        self.pods.setdefault(uid, PodRecord(uid))
        return self._to_newest(wire.KeepWorkload(uid))

    def delete_pod(self, uid: str) -> defer.Deferred:
        """Forget the pod and send Del to every connected proxy."""
        pod = self.pods.pop(uid, None)
        result = self._to_all(wire.DelWorkload(uid))
        if pod is not None and pod.netns is not None:
            pod.netns.close()  # queued Adds hold their own duplicate
        return result

    def shutdown_starting(self, uid: str) -> defer.Deferred:
        """Send the ShutdownStarting extension to every connected proxy."""
        return self._to_all(wire.ShutdownStarting(uid))

    def snapshot_end(self) -> defer.Deferred:
        """Send SnapshotSent to the newest proxy (ends a manual snapshot)."""
        return self._to_newest(wire.SnapshotSent())

    def status(self) -> dict[str, Any]:
        return {
            "socket": self.socket_path,
            "manual_snapshot": self.manual_snapshot,
            "ack_timeout_s": self.ack_timeout,
            "proxies": [proxy.status() for proxy in self.proxies],
            "pods": [pod.to_json() for pod in self.pods.values()],
        }


# -- the HTTP control API -------------------------------------------------------


class _BadRequest(ValueError):
    pass


def _field(body: dict[str, Any], name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value:
        raise _BadRequest(f"field {name!r} is required (a non-empty string)")
    return value


def _acks_json(request: str, uid: str | None, results: list[AckResult]) -> dict[str, Any]:
    out: dict[str, Any] = {"request": request, "acks": [r.to_json() for r in results]}
    if uid is not None:
        out["uid"] = uid
    if not results:
        out["note"] = "no proxy connected" + ("; the pod goes into the next snapshot" if request == "add" else "")
    return out


class _Operation(Resource):
    isLeaf = True

    def __init__(self, agent: ZdsAgent, name: str) -> None:
        super().__init__()
        self.agent = agent
        self.name = name

    def _reply(self, request: Any, code: int, body: dict[str, Any]) -> None:
        if getattr(request, "_disconnected", False) or request.finished:
            return
        request.setResponseCode(code)
        request.setHeader(b"Content-Type", b"application/json")
        request.write(json.dumps(body).encode() + b"\n")
        request.finish()

    def render_GET(self, request: Any) -> bytes:
        if self.name != "status":
            request.setResponseCode(405)
            return json.dumps({"error": f"use POST for /{self.name}"}).encode()
        request.setHeader(b"Content-Type", b"application/json")
        return json.dumps(self.agent.status()).encode() + b"\n"

    def render_POST(self, request: Any) -> Any:
        if self.name == "status":
            return self.render_GET(request)
        try:
            raw = request.content.read() or b"{}"
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise _BadRequest("the body must be a JSON object")
            uid, result = self._start(body)
        except (ValueError, OSError) as exc:  # _BadRequest, JSON errors, NotANetworkNamespace, open errors
            request.setResponseCode(400)
            request.setHeader(b"Content-Type", b"application/json")
            return json.dumps({"error": str(exc)}).encode() + b"\n"
        result.addCallback(lambda results: self._reply(request, 200, _acks_json(self.name, uid, results)))
        result.addErrback(lambda f: self._reply(request, 500, {"error": f.getErrorMessage()}))
        return NOT_DONE_YET

    def _start(self, body: dict[str, Any]) -> tuple[str | None, defer.Deferred]:
        agent = self.agent
        if self.name == "add":
            uid = _field(body, "uid")
            info = wire.WorkloadInfo(_field(body, "name"), _field(body, "namespace"), _field(body, "service_account"))
            return uid, agent.add_pod(uid, info, _field(body, "netns"))
        if self.name == "keep":
            uid = _field(body, "uid")
            return uid, agent.keep_pod(uid)
        if self.name == "delete":
            uid = _field(body, "uid")
            return uid, agent.delete_pod(uid)
        if self.name == "shutdown-starting":
            uid = _field(body, "uid")
            return uid, agent.shutdown_starting(uid)
        if self.name == "snapshot-end":
            return None, agent.snapshot_end()
        raise _BadRequest(f"unknown operation {self.name!r}")


OPERATIONS = ("add", "keep", "delete", "shutdown-starting", "snapshot-end", "status")


def control_resource(agent: ZdsAgent) -> Resource:
    root = Resource()
    for name in OPERATIONS:
        root.putChild(name.encode(), _Operation(agent, name))
    return root


# -- the command line -----------------------------------------------------------------


def _control_address(description: str) -> tuple[str, str, int]:
    """("tcp", host, port) or ("unix", path, 0): where a client reaches the control API that
    ``serve --control DESCRIPTION`` listens on (an endpoint string, or an http URL).

    The endpoint string is read by Twisted's own parser: the endpoint it makes listens on a
    MemoryReactor, which records what a real reactor would have been asked for.
    """
    if description.startswith("http://"):
        url = urlsplit(description)
        return "tcp", url.hostname or "127.0.0.1", url.port or 80
    recorder = MemoryReactor()
    try:
        serverFromString(recorder, description).listen(Factory())
    except Exception as exc:  # noqa: BLE001 - any parse error is the same usage mistake
        raise ValueError(
            f"control address {description!r}: expected tcp:PORT[:interface=IP], unix:PATH or http://HOST:PORT ({exc})"
        ) from None
    if recorder.tcpServers:
        port, _, _, interface = recorder.tcpServers[0]
        return "tcp", interface if interface not in ("", "0.0.0.0", "::") else "127.0.0.1", port
    if recorder.unixServers:
        return "unix", recorder.unixServers[0][0], 0
    raise ValueError(
        f"control address {description!r}: expected tcp:PORT[:interface=IP], unix:PATH or http://HOST:PORT"
    )


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


def call_control(
    control: str, operation: str, body: dict[str, Any] | None = None, timeout: float = 120.0
) -> tuple[int, dict[str, Any]]:
    """One blocking call of the control API: (HTTP status, JSON body)."""
    kind, where, port = _control_address(control)
    conn: http.client.HTTPConnection
    if kind == "unix":
        conn = _UnixHTTPConnection(where, timeout)
    else:
        conn = http.client.HTTPConnection(where, port, timeout=timeout)
    try:
        if operation == "status":
            conn.request("GET", "/status")
        else:
            conn.request("POST", f"/{operation}", json.dumps(body or {}).encode(), {"Content-Type": "application/json"})
        response = conn.getresponse()
        data = response.read()
    finally:
        conn.close()
    try:
        return response.status, json.loads(data)
    except ValueError:
        return response.status, {"error": data.decode("utf-8", "replace")}


CONTROL_HELP = (
    f"Control API address: tcp:PORT[:interface=IP], unix:PATH or http://HOST:PORT "
    f"(default: ${CONTROL_ENV} or {DEFAULT_CONTROL})."
)


def _positive_seconds(value: str) -> float:
    seconds = float(value)
    if seconds <= 0:
        raise ValueError(f"{value} is not a positive number of seconds")
    return seconds


class ServeOptions(usage.Options):
    """``ztunnel-agent serve``."""

    longdesc = "Run the agent: listen for proxies on the ZDS socket and serve the control API."
    optParameters = [
        ["socket", None, DEFAULT_SOCKET_PATH, "ZDS socket path."],
        ["control", None, None, CONTROL_HELP],
        ["ack-timeout", None, ACK_TIMEOUT, "Seconds to wait for each Ack.", _positive_seconds],
        ["hello-timeout", None, HELLO_TIMEOUT, "Seconds to wait for the hello.", _positive_seconds],
    ]
    optFlags = [["manual-snapshot", None, "Do not end snapshots; `snapshot-end` sends SnapshotSent."]]


class ControlOptions(usage.Options):
    """A command that calls the control API of a running agent."""

    longdesc = "Call the control API of a running agent; prints its JSON answer."
    optParameters = [
        ["control", None, None, CONTROL_HELP],
        ["timeout", None, 120.0, "Seconds to wait for the agent.", _positive_seconds],
    ]
    #: options that must be given (besides --control and --timeout)
    required: tuple[str, ...] = ()

    def postOptions(self) -> None:
        missing = [f"--{name}" for name in self.required if not self[name]]
        if missing:
            raise usage.UsageError(f"missing {', '.join(missing)}")

    def body(self) -> dict[str, Any]:
        """The JSON body of the control call."""
        return {name.replace("-", "_"): self[name] for name in self.required}


class PodOptions(ControlOptions):
    optParameters = [["uid", None, None, "The pod's uid."]]
    required = ("uid",)


class AddOptions(PodOptions):
    optParameters = [
        ["name", None, None, "The pod's name."],
        ["namespace", None, None, "The pod's namespace."],
        ["service-account", None, None, "The pod's service account."],
        ["netns", None, None, "Network namespace file, e.g. /var/run/netns/NAME."],
    ]
    required = ("uid", "name", "namespace", "service-account", "netns")


class AgentOptions(usage.Options):
    """``ztunnel-agent``: the options and subcommands, in twistd's conventions."""

    synopsis = "ztunnel-agent"
    longdesc = "A ZDS node agent for tests, demos and labs."
    subCommands = [
        ["serve", None, ServeOptions, "Run the agent."],
        ["add", None, AddOptions, "Add a pod (Add to the newest proxy)."],
        ["keep", None, PodOptions, "Keep a pod (newest proxy; only valid during a snapshot)."],
        ["delete", None, PodOptions, "Delete a pod (Del to every proxy)."],
        ["shutdown-starting", None, PodOptions, "The pod started terminating (to every proxy)."],
        ["snapshot-end", None, ControlOptions, "Send SnapshotSent to the newest proxy."],
        ["status", None, ControlOptions, "Show proxies and pods."],
    ]

    def opt_version(self) -> None:
        print(f"ztunnel-agent (ztwisted {__version__})")
        sys.exit(0)

    def postOptions(self) -> None:
        if self.subCommand is None:
            raise usage.UsageError("name a command")


def _serve(args: ServeOptions) -> int:
    from twisted.internet import reactor
    from twisted.logger import globalLogBeginner, textFileLogObserver

    globalLogBeginner.beginLoggingTo([textFileLogObserver(sys.stderr)], redirectStandardIO=False)
    agent = ZdsAgent(
        reactor,
        args["socket"],
        ack_timeout=args["ack-timeout"],
        hello_timeout=args["hello-timeout"],
        manual_snapshot=bool(args["manual-snapshot"]),
    )
    control = args["control"] or os.environ.get(CONTROL_ENV) or DEFAULT_CONTROL
    try:
        agent.start()
    except OSError as exc:
        print(f"ztunnel-agent: {exc}", file=sys.stderr)
        return 1
    failed: list[str] = []

    def listening(port: Any) -> None:
        address = port.getHost()
        if hasattr(address, "name"):  # a UNIXAddress
            name = address.name.decode() if isinstance(address.name, bytes) else address.name
            where = f"unix:{name}"
        else:
            host = address.host.replace(":", "\\:")  # endpoint-string escaping for IPv6
            where = f"tcp:{address.port}:interface={host}"
        print(json.dumps({"event": "listening", "socket": agent.socket_path, "control": where}), flush=True)

    def cannot_listen(failure: Failure) -> None:
        failed.append(f"cannot serve the control API on {control}: {failure.getErrorMessage()}")
        reactor.stop()

    reactor.callWhenRunning(
        lambda: (
            serverFromString(reactor, control)
            .listen(Site(control_resource(agent)))
            .addCallbacks(listening, cannot_listen)
        )
    )
    reactor.addSystemEventTrigger("before", "shutdown", agent.stop)
    reactor.run()
    if failed:
        print(f"ztunnel-agent: {failed[0]}", file=sys.stderr)
        return 1
    return 0


def _client(command: str, args: ControlOptions) -> int:
    control = args["control"] or os.environ.get(CONTROL_ENV) or DEFAULT_CONTROL
    try:
        status, reply = call_control(control, command, args.body(), timeout=args["timeout"])
    except (OSError, ValueError, http.client.HTTPException) as exc:
        print(f"ztunnel-agent {command}: cannot reach the agent's control API at {control}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(reply, indent=2))
    if status != 200:
        return 2
    acks = reply.get("acks", [])
    return 0 if all(ack.get("ok") for ack in acks) else 1


def main(argv: list[str] | None = None) -> int:
    options = AgentOptions()
    try:
        options.parseOptions(sys.argv[1:] if argv is None else argv)
    except usage.UsageError as error:
        print(f"{options}\nztunnel-agent: {error}", file=sys.stderr)
        return 2
    if options.subCommand == "serve":
        return _serve(options.subOptions)
    return _client(options.subCommand, options.subOptions)


if __name__ == "__main__":
    sys.exit(main())
