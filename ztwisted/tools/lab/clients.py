"""The client apps of node A's pods, and the record of every request they make.

- :class:`PoolingApp`: a fixed set of keep-alive connections through node
  A's SOCKS5, each sending requests one after another at a steady rate (an
  HTTP/1.1 or gRPC client). A connection the server closed while idle is
  replaced before the next request; one that fails a request is dropped and
  replaced at the next one.
- :class:`PerRequestApp`: a new TCP connection per request (Poisson arrivals).

Schedules, payload sizes, payload bytes and think times come from
``random.Random`` seeded with the lab's seed, so two runs send the same
requests at the same planned times.
"""

from __future__ import annotations

import random
import select
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import attr

from ztwisted.tools.harness import Socks5Refused, socks5_connect
from ztwisted.tools.lab.protocol import ClosedEarly, FrameReader, ProtocolError, Request, encode_request, read_response
from ztwisted.tools.workers import Workers


def socks5_connector(proxy: tuple[str, int], source_ip: str, host: str, port: int) -> Callable[[float], socket.socket]:
    """Connections through a node's SOCKS5 port, from a pod's address (loopback mode)."""
    return lambda timeout: socks5_connect(proxy, source_ip, host, port, timeout=timeout)


FAILURE_KINDS = ("reset", "timeout", "refused", "closed", "corrupt", "error")


@attr.s(frozen=True)
class Traffic:
    """What the client apps send."""

    pool_connections: int = attr.ib(default=4)
    pool_rate: float = attr.ib(default=10.0)  # requests/s per pooled connection
    request_rate: float = attr.ib(default=20.0)  # requests/s of the per-request app
    payload_min: int = attr.ib(default=64)
    payload_max: int = attr.ib(default=4096)
    think_max_ms: int = attr.ib(default=40)
    timeout: float = attr.ib(default=3.0)  # per request (and per SOCKS5 connect)


class Clock:
    """Seconds since the start of a run (monotonic)."""

    def __init__(self):
        self.start = time.monotonic()

    def __call__(self) -> float:
        return time.monotonic() - self.start

    def at(self, monotonic: float) -> float:
        return monotonic - self.start


@attr.s
class RequestRecord:
    """One request, as its app saw it. Times are seconds since the run's start."""

    app: str = attr.ib()
    request_id: int = attr.ib()
    planned: float = attr.ib()
    payload_bytes: int = attr.ib()
    started: float | None = attr.ib(default=None)
    ended: float | None = attr.ib(default=None)
    ok: bool = attr.ib(default=False)
    failure: str | None = attr.ib(default=None)  # one of FAILURE_KINDS
    detail: str | None = attr.ib(default=None)
    bytes_sent: int = attr.ib(default=0)  # payload bytes written to the connection
    bytes_echoed: int = attr.ib(default=0)  # payload bytes that came back intact
    server: str | None = attr.ib(default=None)
    new_connection: bool = attr.ib(default=False)
    tunnel_open: float | None = attr.ib(default=None)  # connect -> SOCKS5 success reply (loopback mode)
    first_byte: float | None = attr.ib(default=None)  # connect -> first response byte (new connections)
    latency: float | None = attr.ib(default=None)  # request sent -> whole response

    def as_json(self) -> dict:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in attr.asdict(self).items()}


class Recorder:
    """Every request of every app, thread-safe."""

    def __init__(self, clock: Clock):
        self.clock = clock
        self.records: list[RequestRecord] = []
        self.ok = 0
        self.failed = 0
        self._lock = threading.Lock()

    def finish(self, record: RequestRecord) -> None:
        record.ended = self.clock()
        with self._lock:
            self.records.append(record)
            if record.ok:
                self.ok += 1
            else:
                self.failed += 1


def classify(error: BaseException) -> str:
    """How a request failed, in the lab's words."""
    if isinstance(error, (Socks5Refused, ConnectionRefusedError)):
        return "refused"
    if isinstance(error, TimeoutError):
        return "timeout"
    if isinstance(error, (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)):
        return "reset"
    if isinstance(error, (ClosedEarly, ConnectionError)):
        return "closed"
    if isinstance(error, (EchoMismatch, ProtocolError)):
        return "corrupt"
    return "error"


class EchoMismatch(Exception):
    pass


class RequestMaker:
    """Deterministic requests: ids, payloads and think times from one seeded generator."""

    def __init__(self, rng: random.Random, traffic: Traffic, id_base: int):
        self.rng = rng
        self.traffic = traffic
        self.next_id = id_base

    def make(self) -> Request:
        size = self.rng.randint(self.traffic.payload_min, self.traffic.payload_max)
        request = Request(self.next_id, self.rng.randint(0, self.traffic.think_max_ms), self.rng.randbytes(size))
        self.next_id += 1
        return request


class _App:
    """``connect(timeout)`` opens a connection to the service from the app's pod; ``enter()`` runs first in
    every thread of the app (to enter the pod's network namespace); ``tunnel_opened_on_connect`` says
    whether ``connect`` returns only once the tunnel is open (SOCKS5) or at once (a redirect)."""

    def __init__(
        self,
        name: str,
        connect: Callable[[float], socket.socket],
        traffic: Traffic,
        recorder: Recorder,
        seed: int,
        *,
        enter: Callable[[], None] | None = None,
        tunnel_opened_on_connect: bool = True,
    ):
        self.name = name
        self.connect = connect
        self.enter = enter or (lambda: None)
        self.tunnel_opened_on_connect = tunnel_opened_on_connect
        self.traffic = traffic
        self.recorder = recorder
        self.seed = seed
        self.connections_opened = 0
        self.idle_closes = 0  # keep-alive connections the server closed between requests
        #: requests planned at or after this (seconds since the start) are not sent
        self.deadline = float("inf")
        self._workers = Workers()
        self._lock = threading.Lock()

    def _connect(self, record: RequestRecord) -> tuple[socket.socket, float]:
        started = time.monotonic()
        record.new_connection = True
        sock = self.connect(self.traffic.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.tunnel_opened_on_connect:
            record.tunnel_open = time.monotonic() - started
        with self._lock:
            self.connections_opened += 1
        return sock, started

    def _exchange(
        self, sock: socket.socket, request: Request, record: RequestRecord, connect_started: float | None
    ) -> None:
        sock.settimeout(self.traffic.timeout)
        reader = FrameReader(sock)
        sent_at = time.monotonic()
        sock.sendall(encode_request(request))
        record.bytes_sent = len(request.payload)
        try:
            response = read_response(reader)
        finally:
            if connect_started is not None and reader.first_byte_at is not None:
                record.first_byte = reader.first_byte_at - connect_started
        record.latency = time.monotonic() - sent_at
        record.server = response.server
        if response.request_id != request.request_id or response.payload != request.payload:
            raise EchoMismatch(
                f"answer to request {request.request_id} was for {response.request_id} with "
                f"{len(response.payload)} of {len(request.payload)} bytes"
            )
        record.bytes_echoed = len(response.payload)
        record.ok = True

    def _fail(self, record: RequestRecord, error: BaseException) -> None:
        record.failure = classify(error)
        record.detail = f"{type(error).__name__}: {error}"

    def stop(self, timeout: float = 10.0) -> None:
        self._workers.stop(timeout)


class PoolingApp(_App):
    """Keep-alive connections, each carrying requests one after another."""

    def start(self, clock: Clock) -> PoolingApp:
        for index in range(self.traffic.pool_connections):
            self._workers.spawn(self._connection, clock, index, name=f"{self.name}-{index}")
        return self

    def _connection(self, clock: Clock, index: int) -> None:
        self.enter()
        rng = random.Random(f"{self.seed}/{self.name}/{index}")
        maker = RequestMaker(rng, self.traffic, (index + 1) << 32)
        interval = 1.0 / self.traffic.pool_rate
        planned = rng.uniform(0, interval)  # stagger the connections
        sock: socket.socket | None = None
        try:
            while planned < self.deadline:
                if self._workers.stopping.wait(max(0.0, planned - clock())):
                    return
                request = maker.make()
                record = RequestRecord(self.name, request.request_id, planned, len(request.payload))
                planned += interval * rng.uniform(0.8, 1.2)
                record.started = clock()
                if sock is not None and _closed_by_peer(sock):
                    sock.close()
                    sock = None
                    with self._lock:
                        self.idle_closes += 1
                connect_started = None
                try:
                    if sock is None:
                        sock, connect_started = self._connect(record)
                    self._exchange(sock, request, record, connect_started)
                except (OSError, EchoMismatch, ProtocolError) as e:
                    self._fail(record, e)
                    if sock is not None:
                        sock.close()
                        sock = None
                self.recorder.finish(record)
        finally:
            if sock is not None:
                sock.close()


class PerRequestApp(_App):
    """A new connection for every request."""

    max_concurrent = 64

    def start(self, clock: Clock) -> PerRequestApp:
        self._executor = ThreadPoolExecutor(self.max_concurrent, thread_name_prefix=self.name, initializer=self.enter)
        self._workers.spawn(self._schedule, clock, name=f"{self.name}-schedule")
        return self

    def _schedule(self, clock: Clock) -> None:
        rng = random.Random(f"{self.seed}/{self.name}")
        maker = RequestMaker(rng, self.traffic, 1 << 40)
        planned = rng.expovariate(self.traffic.request_rate)
        while planned < self.deadline and not self._workers.stopping.wait(max(0.0, planned - clock())):
            request = maker.make()
            record = RequestRecord(self.name, request.request_id, planned, len(request.payload))
            self._executor.submit(self._one, clock, request, record)
            planned += rng.expovariate(self.traffic.request_rate)

    def _one(self, clock: Clock, request: Request, record: RequestRecord) -> None:
        record.started = clock()
        sock = None
        try:
            sock, connect_started = self._connect(record)
            self._exchange(sock, request, record, connect_started)
        except (OSError, EchoMismatch, ProtocolError) as e:
            self._fail(record, e)
        finally:
            if sock is not None:
                sock.close()
            self.recorder.finish(record)

    def stop(self, timeout: float = 10.0) -> None:
        super().stop(timeout)
        self._executor.shutdown(wait=True)


def _closed_by_peer(sock: socket.socket) -> bool:
    """True if the server closed (or reset) this idle connection."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            return False
        sock.settimeout(0.5)
        return sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True
