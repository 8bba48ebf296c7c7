"""Support for the drain-strategy and restart tests: a recording HBONE peer, nodes, and load.

:class:`HbonePeer` is an HBONE client under the test's control. It speaks
TLS 1.3 with a client certificate from the nodes' dev CA and HTTP/2 (``h2``)
over an ``ssl.MemoryBIO``, so it sees exactly how the server ended the TLS
connection: ``close_notify`` (``SSLZeroReturnError``) or a TCP FIN/RST
without it. It parses every received frame itself (``hyperframe``) and
records, with a monotonic timestamp, GOAWAY, PING, RST_STREAM and
END_STREAM; GOAWAY frames are kept from ``h2``, which would otherwise close
its state machine and refuse the frames of streams still in flight.
"""

from __future__ import annotations

import hashlib
import os
import queue
import random
import selectors
import signal
import socket
import ssl
import threading
import time
from collections.abc import Callable
from pathlib import Path

import attr
import h2.config
import h2.connection
import h2.events
import h2.exceptions
import yaml
from hyperframe.frame import Frame, GoAwayFrame, RstStreamFrame

from tests.integration.conftest import NODE_A_CONTROL_IP, NODE_B_CONTROL_IP, TWO_NODE_MESH
from tests.support import echo_through, wait_until
from ztwisted.ca import CertificateAuthority, IssuedCertificate
from ztwisted.identity import SpiffeId
from ztwisted.tools.harness import NodeProcess, socks5_connect
from ztwisted.tools.workers import Workers

MAX_STREAM_ID = 2**31 - 1
CANCEL = 0x8
CLIENT_ID = SpiffeId("cluster.local", "default", "client")
ECHO_HOST = "echo.default.svc.cluster.local"


# -- the recording HBONE peer ----------------------------------------------------------


@attr.s(frozen=True)
class WireEvent:
    """Something the peer received; ``at`` is ``time.monotonic()``."""

    at: float = attr.ib()
    kind: str = attr.ib()  # goaway, ping, rst_stream, end_stream, headers, close_notify, tcp_fin, tcp_reset, tls_eof
    stream_id: int = attr.ib(default=0)
    last_stream_id: int | None = attr.ib(default=None)
    error_code: int | None = attr.ib(default=None)


class PeerTunnel:
    """One CONNECT stream of an :class:`HbonePeer`."""

    def __init__(self, peer: HbonePeer, stream_id: int):
        self.peer = peer
        self.stream_id = stream_id
        self.status: int | None = None
        self.answered = threading.Event()
        self.finished = threading.Event()  # END_STREAM or RST_STREAM received, or the connection ended
        self.received = bytearray()
        self.sent = bytearray()
        self.reset_code: int | None = None
        self.ended_cleanly = False  # END_STREAM received
        self.ended_at: float | None = None
        self._pending = bytearray()
        self._end_pending = False
        self._local_closed = False

    def send(self, data: bytes) -> None:
        self.sent += data
        self.peer._call(lambda: self.peer._queue_data(self, data))

    def end(self) -> None:
        """Half-close (END_STREAM once everything queued has been sent)."""
        self.peer._call(lambda: self.peer._queue_end(self))

    def echo_round(self, data: bytes, timeout: float = 10.0) -> None:
        """Send ``data`` and wait until the echo of everything sent so far has come back."""
        self.send(data)
        wait_until(lambda: len(self.received) >= len(self.sent) or self.finished.is_set(), timeout, "the echo")

    def wait_finished(self, timeout: float = 10.0) -> PeerTunnel:
        if not self.finished.wait(timeout):
            raise AssertionError(f"stream {self.stream_id} did not end within {timeout} s")
        return self

    @property
    def byte_exact(self) -> bool:
        return self.ended_cleanly and bytes(self.received) == bytes(self.sent)


class HbonePeer:
    """An HBONE client connection that records what the server sends and how it ends."""

    def __init__(self, issued: IssuedCertificate, server_ip: str, *, source_ip: str, port: int = 15008, workdir: Path):
        self.issued = issued
        self.server = (server_ip, port)
        self.source_ip = source_ip
        self.workdir = Path(workdir)
        self.events: list[WireEvent] = []
        self.tunnels: dict[int, PeerTunnel] = {}
        self.connected_at: float | None = None
        #: how the TLS connection ended: close_notify, tls_eof (no close_notify), tcp_reset, or None while open
        self.ending: str | None = None
        self.closed = threading.Event()
        self._commands: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._frame_buffer = bytearray()
        self._stopping = False

    # -- connecting ---------------------------------------------------------------

    def connect(self, timeout: float = 5.0) -> HbonePeer:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.check_hostname = False  # identities are URI SANs, no DNS names
        context.load_verify_locations(cadata=self.issued.roots_pem.decode())
        context.set_alpn_protocols(["h2"])
        self.workdir.mkdir(parents=True, exist_ok=True)
        cert_file = self.workdir / "peer.crt"
        key_file = self.workdir / "peer.key"
        cert_file.write_bytes(self.issued.cert_pem + self.issued.chain_pem)
        key_file.write_bytes(self.issued.key_pem)
        context.load_cert_chain(str(cert_file), str(key_file))
        self.sock = socket.create_connection(self.server, timeout=timeout, source_address=(self.source_ip, 0))
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self.tls = context.wrap_bio(self._incoming, self._outgoing, server_side=False)
        while True:
            try:
                self.tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                self._send_tls()
                data = self.sock.recv(65536)
                if not data:
                    raise ConnectionError("the server closed the connection during the TLS handshake") from None
                self._incoming.write(data)
        self._send_tls()
        if self.tls.selected_alpn_protocol() != "h2":
            raise ConnectionError(f"ALPN {self.tls.selected_alpn_protocol()!r}, not h2")
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.h2.initiate_connection()
        self._flush()
        self.connected_at = time.monotonic()
        self._wake_r, self._wake_w = socket.socketpair()
        self.sock.settimeout(10.0)
        self._thread = threading.Thread(target=self._run, name=f"hbone-peer-{self.server}", daemon=True)
        self._thread.start()
        return self

    def open_tunnel(self, authority: str, timeout: float = 5.0) -> PeerTunnel:
        """Send a CONNECT and wait for the answer; the tunnel's ``status`` is the answer's status."""
        made: queue.Queue = queue.Queue()

        def send_connect():
            stream_id = self.h2.get_next_available_stream_id()
            tunnel = PeerTunnel(self, stream_id)
            self.tunnels[stream_id] = tunnel
            self.h2.send_headers(stream_id, [(":method", "CONNECT"), (":authority", authority)])
            made.put(tunnel)

        self._call(send_connect)
        tunnel = made.get(timeout=timeout)
        if not tunnel.answered.wait(timeout):
            raise AssertionError(f"no answer to CONNECT {authority} within {timeout} s")
        return tunnel

    def close(self) -> None:
        self._stopping = True
        try:
            self._wake_w.send(b"x")
        except (OSError, AttributeError):
            pass
        thread = getattr(self, "_thread", None)
        if thread is not None:
            thread.join(5)
        for sock in (getattr(self, "sock", None), getattr(self, "_wake_r", None), getattr(self, "_wake_w", None)):
            if sock is not None:
                sock.close()

    # -- what the tests read ----------------------------------------------------------

    def of_kind(self, kind: str) -> list[WireEvent]:
        with self._lock:
            return [event for event in self.events if event.kind == kind]

    def goaways(self) -> list[WireEvent]:
        return self.of_kind("goaway")

    def wait_for(self, kind: str, count: int = 1, timeout: float = 10.0) -> list[WireEvent]:
        return wait_until(
            lambda: (found := self.of_kind(kind)) and len(found) >= count and found, timeout, f"{count} {kind}"
        )

    def wait_closed(self, timeout: float = 10.0) -> str:
        if not self.closed.wait(timeout):
            raise AssertionError(f"the server did not end the connection within {timeout} s")
        return self.ending

    # -- the connection's own thread ------------------------------------------------------

    def _call(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self.sock, selectors.EVENT_READ)
        selector.register(self._wake_r, selectors.EVENT_READ)
        try:
            while not self._stopping and not self.closed.is_set():
                for key, _ in selector.select(0.5):
                    if key.fileobj is self._wake_r:
                        self._wake_r.recv(4096)
                    else:
                        self._read_socket()
                while not self._commands.empty() and not self.closed.is_set():
                    self._commands.get_nowait()()
                    self._flush()
        except Exception as e:  # noqa: BLE001 - a broken peer must show in the test, not hang it
            self._record("peer_error", error_code=None)
            self._end(f"peer error: {e!r}")
        finally:
            selector.close()

    def _read_socket(self) -> None:
        try:
            data = self.sock.recv(262144)
        except ConnectionResetError:
            self._record("tcp_reset")
            self._end("tcp_reset")
            return
        if not data:
            self._record("tcp_fin")
            self._incoming.write_eof()
        else:
            self._incoming.write(data)
        while self.ending is None:
            try:
                plain = self.tls.read(262144)
            except ssl.SSLWantReadError:
                break
            except ssl.SSLZeroReturnError:
                plain = b""
            except ssl.SSLEOFError:
                self._record("tls_eof")
                self._end("tls_eof")
                return
            if not plain:
                # A memory-BIO read returns b"" (or raises SSLZeroReturnError) only for close_notify.
                self._record("close_notify")
                self._answer_close_notify()
                self._end("close_notify")
                return
            self._frames_received(plain)
        self._flush()
        if not data and self.ending is None:
            self._end("tls_eof")

    def _answer_close_notify(self) -> None:
        # The server (Twisted's TLS) waits for our close_notify before it closes TCP.
        try:
            self.tls.unwrap()
        except ssl.SSLError:
            pass
        self._send_tls()

    def _end(self, how: str) -> None:
        if self.ending is None:
            self.ending = how
        for tunnel in self.tunnels.values():
            if not tunnel.finished.is_set():
                tunnel.ended_at = time.monotonic()
                tunnel.finished.set()
        self.closed.set()

    # -- frames ------------------------------------------------------------------------

    def _frames_received(self, plain: bytes) -> None:
        self._frame_buffer += plain
        for_h2 = bytearray()
        while len(self._frame_buffer) >= 9:
            frame, length = Frame.parse_frame_header(memoryview(bytes(self._frame_buffer[:9])))
            if len(self._frame_buffer) < 9 + length:
                break
            raw = bytes(self._frame_buffer[: 9 + length])
            del self._frame_buffer[: 9 + length]
            frame.parse_body(memoryview(raw[9:]))
            if isinstance(frame, GoAwayFrame):
                # Kept from h2, which would close its state machine (python-hyper/h2 #1181).
                self._record("goaway", last_stream_id=frame.last_stream_id, error_code=frame.error_code)
                continue
            if isinstance(frame, RstStreamFrame):
                self._record("rst_stream", stream_id=frame.stream_id, error_code=frame.error_code)
            elif frame.type == 0x6 and "ACK" not in frame.flags:
                self._record("ping")
            elif frame.type in (0x0, 0x1):
                if frame.type == 0x1:
                    self._record("headers", stream_id=frame.stream_id)
                if "END_STREAM" in frame.flags:
                    self._record("end_stream", stream_id=frame.stream_id)
            for_h2 += raw
        if for_h2:
            for event in self.h2.receive_data(bytes(for_h2)):
                self._h2_event(event)

    def _h2_event(self, event) -> None:
        tunnel = self.tunnels.get(getattr(event, "stream_id", 0) or 0)
        if isinstance(event, h2.events.ResponseReceived) and tunnel is not None:
            tunnel.status = int(dict(event.headers)[":status"])
            tunnel.answered.set()
        elif isinstance(event, h2.events.DataReceived):
            if tunnel is not None:
                tunnel.received += event.data
            try:
                self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            except h2.exceptions.StreamClosedError:
                pass
        elif isinstance(event, h2.events.StreamEnded) and tunnel is not None:
            tunnel.ended_cleanly = True
            self._tunnel_done(tunnel)
        elif isinstance(event, h2.events.StreamReset) and tunnel is not None:
            tunnel.reset_code = event.error_code
            self._tunnel_done(tunnel)
        elif isinstance(event, (h2.events.WindowUpdated, h2.events.RemoteSettingsChanged)):
            for each in list(self.tunnels.values()):
                self._send_pending(each)

    def _tunnel_done(self, tunnel: PeerTunnel) -> None:
        tunnel.ended_at = time.monotonic()
        tunnel.answered.set()
        tunnel.finished.set()

    def _queue_data(self, tunnel: PeerTunnel, data: bytes) -> None:
        tunnel._pending += data
        self._send_pending(tunnel)

    def _queue_end(self, tunnel: PeerTunnel) -> None:
        tunnel._end_pending = True
        self._send_pending(tunnel)

    def _send_pending(self, tunnel: PeerTunnel) -> None:
        if tunnel._local_closed or tunnel.reset_code is not None:
            return
        try:
            while tunnel._pending:
                window = min(self.h2.local_flow_control_window(tunnel.stream_id), self.h2.max_outbound_frame_size)
                if window <= 0:
                    return
                chunk = bytes(tunnel._pending[:window])
                del tunnel._pending[:window]
                self.h2.send_data(tunnel.stream_id, chunk)
            if tunnel._end_pending:
                tunnel._local_closed = True
                self.h2.end_stream(tunnel.stream_id)
        except h2.exceptions.StreamClosedError:
            tunnel._local_closed = True

    def _flush(self) -> None:
        if self.ending is not None:
            return
        data = self.h2.data_to_send()
        if data:
            self.tls.write(data)
        self._send_tls()

    def _send_tls(self) -> None:
        data = self._outgoing.read()
        if data:
            try:
                self.sock.sendall(data)
            except OSError:
                pass

    def _record(
        self, kind: str, stream_id: int = 0, last_stream_id: int | None = None, error_code: int | None = None
    ) -> None:
        with self._lock:
            self.events.append(WireEvent(time.monotonic(), kind, stream_id, last_stream_id, error_code))


def dev_ca(node: NodeProcess) -> CertificateAuthority:
    return CertificateAuthority.load_or_create_dev(node.state_dir)


class Peers:
    """Makes :class:`HbonePeer` connections as the ``client`` workload, and closes them all at the end."""

    def __init__(self, workdir: Path):
        self.workdir = Path(workdir)
        self.opened: list[HbonePeer] = []
        self._issued: IssuedCertificate | None = None

    def connect(self, node: NodeProcess, server_ip: str, source_ip: str) -> HbonePeer:
        if self._issued is None:
            self._issued = dev_ca(node).issue(CLIENT_ID)
        peer = HbonePeer(self._issued, server_ip, source_ip=source_ip, workdir=self.workdir / f"peer{len(self.opened)}")
        self.opened.append(peer)
        return peer.connect()

    def close(self) -> None:
        for peer in self.opened:
            peer.close()


def tunnel_in_flight(peer: HbonePeer, authority: str, size: int = 64 * 1024) -> PeerTunnel:
    """A CONNECT tunnel (answered 200) that has carried one echo round and stays open."""
    tunnel = peer.open_tunnel(authority)
    assert tunnel.status == 200, f"CONNECT {authority} answered {tunnel.status}"
    tunnel.echo_round(os.urandom(size))
    assert bytes(tunnel.received) == bytes(tunnel.sent)
    return tunnel


def finish_tunnel(tunnel: PeerTunnel, size: int = 64 * 1024, timeout: float = 10.0) -> PeerTunnel:
    """Send a last piece, half-close, and wait for the server's END_STREAM (or reset)."""
    tunnel.send(os.urandom(size))
    tunnel.end()
    return tunnel.wait_finished(timeout)


# -- nodes ---------------------------------------------------------------------------


class Nodes:
    """node-a and node-b, each with its own copy of the mesh file (so one can be edited alone)."""

    def __init__(
        self, tmp_path: Path, *, a_args: tuple[str, ...] = (), b_args: tuple[str, ...] = (), mesh: str = TWO_NODE_MESH
    ):
        self.tmp_path = Path(tmp_path)
        self.state = self.tmp_path / "state"
        self.a_config = self._write_config("a-config", mesh)
        self.b_config = self._write_config("b-config", mesh)
        self.a = self.node_a(a_args)
        self.b = self.node_b(b_args)
        self.extra: list[NodeProcess] = []

    def _write_config(self, folder: str, mesh: str) -> Path:
        path = self.tmp_path / folder / "mesh.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(mesh)
        return path

    def node_a(self, args: tuple[str, ...] = (), workdir: str = "a") -> NodeProcess:
        return NodeProcess(
            self.tmp_path / workdir,
            name="node-a",
            control_ip=NODE_A_CONTROL_IP,
            config=self.a_config,
            node="node-a",
            state_dir=self.state,
            extra_args=args,
        )

    def node_b(self, args: tuple[str, ...] = (), workdir: str = "b") -> NodeProcess:
        return NodeProcess(
            self.tmp_path / workdir,
            name="node-b",
            control_ip=NODE_B_CONTROL_IP,
            config=self.b_config,
            node="node-b",
            state_dir=self.state,
            extra_args=args,
        )

    def start(self, a: bool = True) -> Nodes:
        self.b.start()
        if a:
            try:
                self.a.start()
            except BaseException:
                self.stop()
                raise
        return self

    def stop(self) -> None:
        for node in (self.a, self.b, *self.extra):
            try:
                node.stop()
            except RuntimeError:
                node.kill()


def send_signal(node: NodeProcess, sig: int = signal.SIGTERM) -> float:
    """Signal the node's process; returns when (monotonic)."""
    node.process.send_signal(sig)
    return time.monotonic()


def wait_exit(node: NodeProcess, timeout: float) -> int:
    """The process's exit status once it exits; AssertionError if it is still running at ``timeout``."""
    try:
        return node.process.wait(timeout)
    except Exception:
        raise AssertionError(f"{node.name} still running {timeout} s later:\n{node.log_tail()}") from None


class TimedRequest:
    """An admin request made from a thread; records when its answer arrived."""

    def __init__(self, node: NodeProcess, path: str, method: str):
        self.answer: tuple[int, bytes] | None = None
        self.error: BaseException | None = None
        self.sent_at = time.monotonic()
        self.answered_at: float | None = None
        self._thread = threading.Thread(target=self._run, args=(node, path, method), daemon=True)
        self._thread.start()

    def _run(self, node, path, method):
        try:
            self.answer = node.http("admin", path, method)
        except BaseException as e:  # noqa: BLE001 - shown by wait()
            self.error = e
        self.answered_at = time.monotonic()

    def wait(self, timeout: float = 10.0) -> tuple[int, bytes]:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise AssertionError(f"no answer within {timeout} s")
        if self.error is not None:
            raise self.error
        return self.answer

    @property
    def elapsed(self) -> float:
        return self.answered_at - self.sent_at


def config_without_workload(mesh: str, name: str) -> str:
    """The mesh YAML ``mesh`` without the workload called ``name``."""
    document = yaml.safe_load(mesh)
    document["workloads"] = [w for w in document["workloads"] if w["name"] != name]
    return yaml.safe_dump(document, sort_keys=False)


# -- load through node-a's SOCKS5 ---------------------------------------------------------


class ShortConnections:
    """Clients that keep opening short SOCKS5 connections, each a byte-exact 1-64 KB echo."""

    def __init__(
        self,
        proxy: tuple[str, int],
        source_ip: str,
        host: str = ECHO_HOST,
        port: int = 80,
        clients: int = 3,
        seed: int = 0,
    ):
        self.proxy = proxy
        self.source_ip = source_ip
        self.host = host
        self.port = port
        self.clients = clients
        self.made = 0
        self.bytes_verified = 0
        self.failures: list[str] = []
        self.seed = seed
        self._lock = threading.Lock()
        self._workers = Workers()

    def start(self) -> ShortConnections:
        for i in range(self.clients):
            self._workers.spawn(self._client, self.seed + i)
        return self

    def stop(self) -> None:
        self._workers.stop(30)

    def _client(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self._workers.stopping.is_set():
            payload = rng.randbytes(rng.randint(1024, 64 * 1024))
            try:
                with socks5_connect(self.proxy, self.source_ip, self.host, self.port, timeout=10) as sock:
                    echoed = echo_through(sock, payload, timeout=10)
                outcome = (
                    None
                    if echoed == payload
                    else f"echo of {len(payload)} bytes came back as {len(echoed)} bytes, not equal"
                )
            except OSError as e:
                outcome = f"{type(e).__name__}: {e}"
            with self._lock:
                self.made += 1
                if outcome is None:
                    self.bytes_verified += len(payload)
                else:
                    self.failures.append(outcome)


class LongTunnel:
    """One SOCKS5 connection that streams data continuously; the echo is checked by hash at the end."""

    def __init__(
        self,
        proxy: tuple[str, int],
        source_ip: str,
        host: str = ECHO_HOST,
        port: int = 80,
        chunk: int = 16 * 1024,
        pause: float = 0.002,
    ):
        self.sock = socks5_connect(proxy, source_ip, host, port, timeout=10)
        self.sock.settimeout(30)
        self.chunk = chunk
        self.pause = pause
        self.sent = 0
        self.received = 0
        self._sent_hash = hashlib.sha256()
        self._received_hash = hashlib.sha256()
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._sender = threading.Thread(target=self._send, daemon=True)
        self._reader = threading.Thread(target=self._read, daemon=True)

    def start(self) -> LongTunnel:
        self._sender.start()
        self._reader.start()
        return self

    def _send(self) -> None:
        rng = random.Random(1)
        try:
            while not self._stop.is_set():
                piece = rng.randbytes(self.chunk)
                self._sent_hash.update(piece)
                self.sock.sendall(piece)
                self.sent += len(piece)
                time.sleep(self.pause)
            self.sock.shutdown(socket.SHUT_WR)
        except OSError as e:
            self.error = e

    def _read(self) -> None:
        try:
            while True:
                data = self.sock.recv(262144)
                if not data:
                    return
                self._received_hash.update(data)
                self.received += len(data)
        except OSError as e:
            self.error = e

    def finish(self, timeout: float = 30.0) -> bool:
        """Stop sending, half-close, read the rest; True when the echo equals what was sent."""
        self._stop.set()
        self._sender.join(timeout)
        self._reader.join(timeout)
        self.sock.close()
        return (
            self.error is None
            and self.sent == self.received
            and self._sent_hash.digest() == self._received_hash.digest()
        )


# -- restart --------------------------------------------------------------------------


@attr.s
class RestartResult:
    connections_made: int = attr.ib(default=0)
    connections_failed: int = attr.ib(default=0)
    bytes_verified: int = attr.ib(default=0)
    long_tunnels: int = attr.ib(default=0)
    long_tunnels_exact: int = attr.ib(default=0)
    long_tunnel_bytes: int = attr.ib(default=0)
    old_exit_statuses: list = attr.ib(factory=list)
    failures: list = attr.ib(factory=list)


def restart_under_load(
    current: NodeProcess,
    make_next: Callable[[int], NodeProcess],
    socks5: Callable[[], tuple[str, int]],
    source_ip: str,
    *,
    rounds: int,
    before: float = 0.5,
    after: float = 1.5,
    result: RestartResult | None = None,
) -> tuple[NodeProcess, RestartResult]:
    """Restart a node ``rounds`` times while short connections and a long tunnel run through node-a.

    Each round: a long tunnel starts; a second process (``make_next(round)``,
    same config, state and ports) starts and becomes ready; the current one
    gets SIGTERM; the load goes on for ``after`` seconds; the long tunnel
    ends (its echo checked byte for byte) and the old process must exit.
    Returns the process left running and the counts.
    """
    result = result or RestartResult()
    load = ShortConnections(socks5(), source_ip).start()
    try:
        for round_number in range(rounds):
            long_tunnel = LongTunnel(socks5(), source_ip).start()
            time.sleep(before)
            successor = make_next(round_number).start()
            time.sleep(0.2)
            current.process.send_signal(signal.SIGTERM)
            time.sleep(after)
            exact = long_tunnel.finish()
            result.long_tunnels += 1
            result.long_tunnels_exact += int(exact)
            result.long_tunnel_bytes += long_tunnel.received if exact else 0
            if not exact:
                result.failures.append(
                    f"round {round_number}: long tunnel sent {long_tunnel.sent}, received {long_tunnel.received}, error {long_tunnel.error!r}"
                )
            status = wait_exit(current, 15)
            result.old_exit_statuses.append(status)
            current.stop()  # closes its log file
            current = successor
    finally:
        load.stop()
        result.connections_made += load.made
        result.connections_failed += len(load.failures)
        result.bytes_verified += load.bytes_verified
        result.failures.extend(load.failures[:20])
    return current, result
