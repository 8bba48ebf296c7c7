"""The proxy side of ZDS: connect to the node agent, follow its pods, ack each request.

:class:`ZdsClient` (a Twisted service) connects to the agent's SEQPACKET
socket, sends the hello, and turns each request into a call on an
:class:`IPodManager`; the Ack goes out when that call's Deferred fires.
Requests are handled one at a time, in order.

Errors, as zds.md and ztunnel have them:

- a protocol violation (undecodable or unknown message, missing or surplus
  fd, truncated datagram, an fd that is not a network namespace, Keep or a
  second SnapshotSent after the snapshot...) gets an error Ack, then the
  client drops the connection and reconnects (the agent resends its
  snapshot, which resynchronises both sides);
- a pod proxy that fails to start gets an error Ack carrying the failure's
  message; the connection stays and the start is retried every 5 s.

Neither stops the pods already running: they keep serving while the client
reconnects.
"""

from __future__ import annotations

import os
import socket
from collections import deque
from collections.abc import Callable
from typing import Any

import attrs
from twisted.application import service
from twisted.internet import defer
from twisted.internet.error import ConnectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import Interface

from ztwisted.inpod import wire
from ztwisted.inpod.seqpacket import DEFAULT_MAX_DATAGRAM, SeqpacketConnection, connect_seqpacket
from ztwisted.netns import Netns, NotANetworkNamespace

log = Logger(namespace="ztwisted.inpod.client")

RETRY_INTERVAL = 5.0  # seconds between retries of pods that failed to start (ztunnel's)
DEFAULT_BACKOFF = (0.01, 15.0)  # reconnect delay: first, and cap (doubling in between)


class IPodManager(Interface):
    """What :class:`ZdsClient` drives: the per-pod proxies.

    ``workload_info`` is a :class:`ztwisted.inpod.wire.WorkloadInfo` (attrs:
    ``name``, ``namespace``, ``service_account``); ``netns`` a
    :class:`ztwisted.netns.Netns`, already checked.
    """

    def add_pod(uid, workload_info, netns):
        """Start the pod's proxy; return a Deferred that fires once it serves.

        If it fires, the manager owns ``netns`` and closes it when the pod is
        removed. If it fails, the client keeps ``netns``, sends an error Ack
        with the failure's message and calls ``add_pod`` again every 5 s.
        """

    def remove_pod(uid):
        """Stop the pod's proxy through the drain strategy's *pod removed* event.

        ``running_pods()`` must exclude ``uid`` as soon as this returns; the
        Deferred fires when the pod's connections are done (the Del is acked then).
        """

    def pod_terminating(uid):
        """The pod started terminating (the ShutdownStarting extension); it must
        keep serving. The Deferred fires when the manager has taken note."""

    def running_pods():
        """The uids (a set of str) whose proxies run now."""


class _Metrics:
    """ztunnel's workload_manager_* series plus ZDS error counters."""

    def __init__(self, metrics: Any) -> None:
        self.protocol_errors = metrics.counter(
            "ztwisted_zds_protocol_errors_total",
            "ZDS protocol violations by the node agent (each answered by an error Ack and a reconnect)",
            ["reason"],
        )
        self.start_failures = metrics.counter(
            "ztwisted_zds_pod_start_failures_total", "Pod proxies that failed to start (error Ack; retried every 5 s)"
        )
        self.active = metrics.gauge(
            "workload_manager_active_proxy_count", "The total number current workloads with active proxies"
        )
        self.pending = metrics.gauge(
            "workload_manager_pending_proxy_count", "The total number current workloads with pending proxies"
        )
        self.started = metrics.counter(
            "workload_manager_proxies_started_total", "The total number of proxies that were started"
        )
        self.stopped = metrics.counter(
            "workload_manager_proxies_stopped_total", "The total number of proxies that were stopped"
        )


@attrs.define
class _Pending:
    """A pod whose proxy failed to start, kept for the next retry."""

    workload_info: wire.WorkloadInfo
    netns: Netns


@attrs.define(eq=False)
class _Job:
    """One unit of serial work: a received datagram, or a retry round."""

    session: _Session
    run: Callable[[], Any]
    fds: list[int] = attrs.Factory(list)

    def discard(self) -> None:
        for fd in self.fds:
            _close_fd(fd)
        self.fds.clear()


@attrs.define
class _SerialJobs:
    """Requests are handled one at a time, in order: the next job starts when the last one's Deferred fires."""

    _jobs: deque[_Job] = attrs.Factory(deque)
    _busy: bool = False
    _pumping: bool = False

    def enqueue(self, job: _Job) -> None:
        self._jobs.append(job)
        self._pump()

    def discard_session(self, session: _Session) -> None:
        for job in [job for job in self._jobs if job.session is session]:
            self._jobs.remove(job)
            job.discard()

    def _pump(self) -> None:
        if self._pumping:
            return  # a job finished synchronously: the loop below carries on
        self._pumping = True
        try:
            while not self._busy and self._jobs:
                job = self._jobs.popleft()
                if not job.session.open:
                    job.discard()
                    continue
                self._busy = True
                job.fds = []  # the job's handler owns them now
                result = defer.maybeDeferred(job.run)
                result.addErrback(lambda f: log.failure("ZDS request handling failed unexpectedly", f))
                result.addBoth(self._job_done)
        finally:
            self._pumping = False

    def _job_done(self, _: Any) -> None:
        self._busy = False
        self._pump()


def validate_datagram(
    payload: bytes, fds: list[int], flags: int, max_datagram: int
) -> tuple[wire.Request, Netns | None]:
    """Decode and check one datagram; on any error every received fd is closed."""
    try:
        if flags & socket.MSG_TRUNC:
            raise wire.ZdsProtocolError("truncated", f"received a truncated message (larger than {max_datagram} bytes)")
        if flags & socket.MSG_CTRUNC:
            raise wire.ZdsProtocolError("control_truncated", "received truncated ancillary data (too many fds?)")
        if len(fds) > 1:
            raise wire.ZdsProtocolError("too_many_fds", f"expected at most 1 fd with a message, got {len(fds)}")
        request = wire.decode_request(payload)
        if isinstance(request, wire.AddWorkload):
            if not fds:
                raise wire.ZdsProtocolError("missing_fd", f"add for uid {request.uid!r} without a network namespace fd")
        elif fds:
            raise wire.ZdsProtocolError("unexpected_fd", f"{request.kind} request carries an fd; only add may")
    except wire.ZdsProtocolError:
        for fd in fds:
            _close_fd(fd)
        raise
    if not fds:
        return request, None
    fd = fds[0]
    try:
        netns = Netns(fd, name=f"netns of pod {request.uid}")
    except OSError as exc:
        _close_fd(fd)
        raise wire.ZdsProtocolError("not_a_netns", f"the fd sent with add for uid {request.uid!r}: {exc}") from exc
    try:
        netns.check()
    except NotANetworkNamespace as exc:
        netns.close()
        raise wire.ZdsProtocolError("not_a_netns", str(exc)) from exc
    return request, netns


def _close_fd(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


class _Session:
    """One connection to the agent, with its snapshot state."""

    def __init__(self, client: ZdsClient, sock: socket.socket, number: int) -> None:
        self.client = client
        self.number = number
        self.snapshot_received = False
        self.snapshot_names: set[str] = set()
        self.failed = False  # a protocol error: ignore the rest, the connection is closing
        self.conn = SeqpacketConnection(
            client.reactor, sock, self, max_datagram=client.max_datagram, name=f"zds#{number}"
        )

    @property
    def open(self) -> bool:
        return not self.failed and not self.conn.disconnected and self.client._session is self

    def start(self) -> None:
        self.conn.send(wire.encode_hello())
        self.conn.start()

    def ack(self, error: str) -> None:
        try:
            self.conn.send(wire.encode_ack(error))
        except ConnectionDone:
            log.warn(
                "{session}: Ack not sent, the connection to the node agent is gone (error={error!r})",
                session=self.conn.name,
                error=error,
            )

    def protocol_error(self, err: wire.ZdsProtocolError) -> None:
        """Answer with an error Ack and drop the connection (the agent resends its snapshot)."""
        log.error(
            "ZDS protocol error from the node agent ({reason}): {message}; answering with an error Ack "
            "and reconnecting",
            reason=err.reason,
            message=err.message,
        )
        if self.client._metrics is not None:
            self.client._metrics.protocol_errors.labels(reason=err.reason).inc()
        self.failed = True
        self.ack(err.message)
        self.conn.close_after_flush()

    # ISeqpacketHandler
    def datagram_received(self, payload: bytes, fds: list[int], flags: int) -> None:
        self.client._jobs.enqueue(_Job(self, lambda: self.client._handle(self, payload, fds, flags), list(fds)))

    def connection_lost(self, reason: Failure) -> None:
        self.client._session_lost(self, reason)


class ZdsClient(service.Service):
    """Connects to the node agent at ``path`` and keeps ``manager``'s pods in sync with it.

    ``path`` is the agent's socket (:data:`ztwisted.inpod.DEFAULT_SOCKET_PATH` in a real node);
    ``manager`` provides :class:`IPodManager`; ``metrics`` is an optional
    :class:`ztwisted.metrics.Metrics`; ``backoff`` the first and the largest
    reconnect delay in seconds (doubling in between, reset once a snapshot
    arrives). The client is ready (:meth:`ready`) once the current
    connection's snapshot arrived and no pod is pending.

    The client owns the connection (reconnecting with backoff) and turns each
    datagram into a request; :class:`_Pods` carries the requests out.
    """

    name = "zds-client"

    def __init__(
        self,
        reactor: Any,
        path: str,
        manager: IPodManager,
        metrics: Any = None,
        backoff: tuple[float, float] = DEFAULT_BACKOFF,
        *,
        retry_interval: float = RETRY_INTERVAL,
        max_datagram: int = DEFAULT_MAX_DATAGRAM,
        connector: Callable[[str], socket.socket] = connect_seqpacket,
    ) -> None:
        if not 0 < backoff[0] <= backoff[1]:
            raise ValueError(f"backoff must be (first, cap) with 0 < first <= cap, not {backoff!r}")
        self.reactor = reactor
        self.path = str(path)
        self.manager = manager
        self.backoff = backoff
        self.retry_interval = retry_interval
        self.max_datagram = max_datagram
        self._connector = connector  # path -> connected SEQPACKET socket (tests pass socketpair ends)
        self._metrics = _Metrics(metrics) if metrics is not None else None
        self._session: _Session | None = None
        self._sessions_started = 0
        self._delay = backoff[0]
        self._reconnect_call: Any = None
        self._jobs = _SerialJobs()
        self._pods = _Pods(
            reactor=reactor,
            manager=manager,
            metrics=self._metrics,
            retry_interval=retry_interval,
            jobs=self._jobs,
            current_session=lambda: self._session,
        )

    # -- service -------------------------------------------------------------

    def startService(self) -> None:
        super().startService()
        self._connect()

    def stopService(self) -> None:
        super().stopService()
        if self._reconnect_call is not None and self._reconnect_call.active():
            self._reconnect_call.cancel()
        self._reconnect_call = None
        self._pods.stop_retrying()
        if self._session is not None:
            self._session.conn.abort()

    # -- readiness and introspection ---------------------------------------

    @property
    def connected(self) -> bool:
        return self._session is not None

    @property
    def sessions_started(self) -> int:
        """How many connections to the agent were made so far."""
        return self._sessions_started

    def ready(self) -> bool:
        """For the readiness endpoint: connected, snapshot complete, no pod pending."""
        session = self._session
        return session is not None and session.snapshot_received and not self.pending()

    def pending(self) -> set[str]:
        """Uids whose proxy is starting, or failed to start and waits for a retry."""
        return self._pods.pending()

    def status(self) -> dict[str, Any]:
        """A JSON-ready summary (for config dumps and the agent lab)."""
        session = self._session
        return {
            "socket": self.path,
            "connected": session is not None,
            "snapshot_received": bool(session and session.snapshot_received),
            "ready": self.ready(),
            "pending": sorted(self.pending()),
            "running": sorted(self.manager.running_pods()),
        }

    # -- connecting ----------------------------------------------------------

    def _connect(self) -> None:
        self._reconnect_call = None
        if not self.running:
            return
        try:
            sock = self._connector(self.path)
        except OSError as exc:
            log.warn("cannot reach the node agent ({error}); retrying in {delay:.3g} s", error=exc, delay=self._delay)
            self._schedule_reconnect()
            return
        self._sessions_started += 1
        session = _Session(self, sock, self._sessions_started)
        self._session = session
        log.info("connected to the node agent at {path} ({session})", path=self.path, session=session.conn.name)
        session.start()

    def _schedule_reconnect(self) -> None:
        if not self.running or self._reconnect_call is not None:
            return
        self._reconnect_call = self.reactor.callLater(self._delay, self._connect)
        self._delay = min(self._delay * 2, self.backoff[1])

    def _session_lost(self, session: _Session, reason: Failure) -> None:
        if self._session is not session:
            return
        self._session = None
        log.info(
            "connection to the node agent lost ({session}): {reason}",
            session=session.conn.name,
            reason=reason.getErrorMessage(),
        )
        self._pods.forget_pending()
        self._jobs.discard_session(session)
        self._pods.update_gauges()
        self._schedule_reconnect()

    # -- one datagram ----------------------------------------------------------

    def _handle(self, session: _Session, payload: bytes, fds: list[int], flags: int) -> defer.Deferred | None:
        try:
            request, netns = validate_datagram(payload, fds, flags, self.max_datagram)
        except wire.ZdsProtocolError as err:
            session.protocol_error(err)
            return None
        log.info(
            "{session}: {kind} {uid}", session=session.conn.name, kind=request.kind, uid=getattr(request, "uid", "")
        )
        try:
            outcome = self._apply(session, request, netns)
        except wire.ZdsProtocolError as err:
            if netns is not None:
                netns.close()
            session.protocol_error(err)
            return None
        except Exception as exc:  # a bug here must still answer the agent
            log.failure("handling {kind} failed", kind=request.kind)
            outcome = defer.succeed(f"internal error handling {request.kind}: {exc}")
        return outcome.addCallback(session.ack)

    def _apply(self, session: _Session, request: wire.Request, netns: Netns | None) -> defer.Deferred:
        """Carry out a valid request; fires with the Ack's error text ("" for success)."""
        if isinstance(request, wire.AddWorkload):
            assert netns is not None
            return self._pods.add(session, request, netns)
        if isinstance(request, wire.KeepWorkload):
            if session.snapshot_received:
                raise wire.ZdsProtocolError(
                    "keep_after_snapshot", f"keep for uid {request.uid!r} after the snapshot was complete"
                )
            session.snapshot_names.add(request.uid)
            return defer.succeed("")
        if isinstance(request, wire.DelWorkload):
            return self._pods.delete(session, request.uid)
        if isinstance(request, wire.SnapshotSent):
            if session.snapshot_received:
                raise wire.ZdsProtocolError("duplicate_snapshot", "a second SnapshotSent on the same connection")
            self._delay = self.backoff[0]  # a healthy connection: start the backoff over
            self._pods.reconcile(session)
            return defer.succeed("")
        if isinstance(request, wire.ShutdownStarting):
            return _ack_text(self.manager.pod_terminating, request.uid)
        raise wire.ZdsProtocolError("unknown_message", f"unhandled request {request!r}")


@attrs.define(eq=False)
class _Pods:
    """The pods as the client knows them, and the manager calls that change them.

    A pod runs (its namespace's identity is kept, to tell a re-created sandbox
    from a repeated Add), is starting (an ``add_pod`` call in flight), or
    failed to start and waits for the next retry round (its namespace kept).
    """

    reactor: Any
    manager: IPodManager
    metrics: _Metrics | None
    retry_interval: float
    #: retries run as jobs, in order with the requests
    jobs: _SerialJobs
    #: the connection now open, if any: failed starts are kept for retries only while one is
    current_session: Callable[[], _Session | None]
    #: running pods: uid -> (st_dev, st_ino) of their network namespace
    _netns_ids: dict[str, tuple[int, int]] = attrs.field(init=False, factory=dict)
    _pending: dict[str, _Pending] = attrs.field(init=False, factory=dict)  # failed starts, waiting for a retry
    _starting: set[str] = attrs.field(init=False, factory=set)  # add_pod calls in flight
    _retry_call: Any = attrs.field(init=False, default=None)

    def pending(self) -> set[str]:
        return set(self._pending) | self._starting

    def add(self, session: _Session, request: wire.AddWorkload, netns: Netns) -> defer.Deferred:
        uid = request.uid
        if not session.snapshot_received:
            session.snapshot_names.add(uid)
        running_id = self._netns_ids.get(uid)
        if running_id is not None:
            if running_id == (netns.device, netns.inode):
                netns.close()  # same pod, same namespace: nothing to do
                return defer.succeed("")
            # The pod sandbox was re-created: its old namespace (and proxy) are gone.
            # The old proxy's removal ends with closing the listeners, connections
            # and network of whatever the node holds under this uid, so the new one
            # starts only after it (the Ack waits, as for a Del, up to the pod drain
            # timeout), and the pod counts as starting (not ready) meanwhile. The Ack
            # answers the Add, i.e. the new proxy's start; a failed removal of the
            # old one is logged by _remove and does not stop the new one.
            log.info("pod {uid} came back with a new network namespace; replacing its proxy", uid=uid)
            self._starting.add(uid)
            removed = self._remove(uid)
            return removed.addCallback(lambda _: self._start(uid, request.workload_info, netns))
        previous = self._pending.pop(uid, None)
        if previous is not None and previous.netns is not netns:
            previous.netns.close()
        return self._start(uid, request.workload_info, netns)

    def delete(self, session: _Session, uid: str) -> defer.Deferred:
        pending = self._pending.pop(uid, None)
        if pending is not None:
            pending.netns.close()
            self.update_gauges()
        if not session.snapshot_received:
            # Before the snapshot a Del only takes the pod out of it; reconcile stops it.
            session.snapshot_names.discard(uid)
            return defer.succeed("")
        if uid in self._netns_ids or uid in self.manager.running_pods():
            return self._remove(uid)
        return defer.succeed("")

    def reconcile(self, session: _Session) -> None:
        """The snapshot is complete: stop the pods it did not name."""
        stale = (set(self.manager.running_pods()) | set(self._netns_ids)) - session.snapshot_names
        for uid in sorted(stale):
            log.info("pod {uid} was not in the node agent's snapshot; removing its proxy", uid=uid)
            self._remove(uid)  # not awaited: the agent no longer knows the pod
        session.snapshot_received = True
        session.snapshot_names.clear()
        self.update_gauges()
        log.info(
            "snapshot from the node agent complete ({count} pods running, {pending} pending)",
            count=len(self.manager.running_pods()),
            pending=len(self._pending),
        )

    def forget_pending(self) -> None:
        """The connection is gone: pending starts belong to its view, and the next snapshot resends them."""
        self.stop_retrying()
        for pending in self._pending.values():
            pending.netns.close()
        self._pending.clear()

    def stop_retrying(self) -> None:
        if self._retry_call is not None and self._retry_call.active():
            self._retry_call.cancel()
        self._retry_call = None

    def update_gauges(self) -> None:
        if self.metrics is None:
            return
        self.metrics.active.set(len(set(self.manager.running_pods()) | set(self._netns_ids)))
        self.metrics.pending.set(len(self.pending()))

    def _start(self, uid: str, info: wire.WorkloadInfo, netns: Netns) -> defer.Deferred:
        # In flight, the netns belongs to this call: a lost connection must not close it.
        self._pending.pop(uid, None)
        self._starting.add(uid)

        def started(_: Any) -> str:
            self._starting.discard(uid)
            self._netns_ids[uid] = (netns.device, netns.inode)
            if self.metrics is not None:
                self.metrics.started.inc()
            self.update_gauges()
            log.info(
                "proxy for pod {uid} ({namespace}/{name}) started", uid=uid, namespace=info.namespace, name=info.name
            )
            return ""

        def failed(failure: Failure) -> str:
            self._starting.discard(uid)
            message = failure.getErrorMessage()
            if self.current_session() is None:
                netns.close()  # the connection is gone; the next snapshot resends the pod
            else:
                self._pending[uid] = _Pending(info, netns)
                self._schedule_retry()
            if self.metrics is not None:
                self.metrics.start_failures.inc()
            self.update_gauges()
            log.error(
                "proxy for pod {uid} failed to start: {message}; retrying every {interval:g} s",
                uid=uid,
                message=message,
                interval=self.retry_interval,
            )
            return message

        return defer.maybeDeferred(self.manager.add_pod, uid, info, netns).addCallbacks(started, failed)

    def _remove(self, uid: str) -> defer.Deferred:
        """Remove a running pod; fires with "" or the failure's message when it is done."""
        self._netns_ids.pop(uid, None)
        result = _ack_text(self.manager.remove_pod, uid)
        self.update_gauges()

        def stopped(error: str) -> str:
            if self.metrics is not None:
                self.metrics.stopped.inc()
            self.update_gauges()
            return error

        return result.addCallback(stopped)

    # -- retrying failed starts --------------------------------------------------

    def _schedule_retry(self) -> None:
        if self._retry_call is None and self.current_session() is not None:
            self._retry_call = self.reactor.callLater(self.retry_interval, self._retry_due)

    def _retry_due(self) -> None:
        self._retry_call = None
        session = self.current_session()
        if session is not None and self._pending:
            self.jobs.enqueue(_Job(session, self._retry_pending))

    @defer.inlineCallbacks
    def _retry_pending(self):
        for uid in sorted(self._pending):
            pending = self._pending.get(uid)
            if pending is None or self.current_session() is None:
                continue
            log.info("retrying the proxy for pod {uid}", uid=uid)
            yield self._start(uid, pending.workload_info, pending.netns)
        if self._pending:
            self._schedule_retry()


def _ack_text(action: Callable[[str], object], uid: str) -> defer.Deferred:
    """``action(uid)`` (a manager method), firing with "" or the failure's message (logged)."""

    def failed(failure: Failure) -> str:
        log.error(
            "{method}({uid}) failed: {message}", method=action.__name__, uid=uid, message=failure.getErrorMessage()
        )
        return failure.getErrorMessage()

    return defer.maybeDeferred(action, uid).addCallbacks(lambda _: "", failed)
