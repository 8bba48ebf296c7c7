"""A raw HTTP/2 client with a valid mesh certificate, made of hyperframe frames, free to misbehave."""

from __future__ import annotations

import socket
import ssl
import time

import hpack
from hyperframe.frame import ContinuationFrame, Frame, GoAwayFrame, HeadersFrame, SettingsFrame

from tests.integration.conftest import CLIENT_IP, SERVER_IP
from ztwisted.ca import CertificateAuthority
from ztwisted.identity import SpiffeId

CLIENT_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def client_context(two_nodes, tmp_path) -> ssl.SSLContext:
    """TLS as a mesh client: a certificate for the `client` workload from the nodes' dev CA."""
    ca = CertificateAuthority.load_or_create_dev(two_nodes.b.state_dir)
    issued = ca.issue(SpiffeId("cluster.local", "default", "client"))
    cert_file, key_file = tmp_path / "client.crt", tmp_path / "client.key"
    cert_file.write_bytes(issued.cert_pem + issued.chain_pem)
    key_file.write_bytes(issued.key_pem)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False  # identities are URI SANs; HBONE sends no SNI
    context.load_verify_locations(cadata=issued.roots_pem.decode())
    context.load_cert_chain(str(cert_file), str(key_file))
    context.set_alpn_protocols(["h2"])
    return context


class RawClient:
    """An HTTP/2 client made of hyperframe frames, free to misbehave."""

    def __init__(self, context: ssl.SSLContext, receive_buffer: int | None = None):
        raw = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if receive_buffer is not None:
            # Set before connecting so the advertised TCP window stays small.
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        raw.settimeout(10)
        raw.bind((CLIENT_IP, 0))
        raw.connect((SERVER_IP, 15008))
        self.sock = context.wrap_socket(raw)
        assert self.sock.selected_alpn_protocol() == "h2"
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()  # one per connection: HPACK state spans its header blocks
        self.next_stream_id = 1
        self._buffer = b""
        settings = SettingsFrame(0)
        self.sock.sendall(CLIENT_PREFACE + settings.serialize())
        # The server speaks first: its SETTINGS, which we acknowledge as a good client would.
        while True:
            frame = self.read_frame()
            if isinstance(frame, SettingsFrame) and "ACK" not in frame.flags:
                break
        self.sock.sendall(SettingsFrame(0, flags=["ACK"]).serialize())

    def read_frame(self) -> Frame:
        header = self._read_exact(9)
        frame, length = Frame.parse_frame_header(memoryview(header))
        frame.parse_body(memoryview(self._read_exact(length)))
        return frame

    def _read_exact(self, size: int) -> bytes:
        while len(self._buffer) < size:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed by the server")
            self._buffer += chunk
        data, self._buffer = self._buffer[:size], self._buffer[size:]
        return data

    def headers_frames(self, headers, max_frame: int = 16384, huffman: bool = True) -> tuple[int, bytes]:
        """A new stream's request headers, split into HEADERS + CONTINUATION frames as needed."""
        stream_id = self.next_stream_id
        self.next_stream_id += 2
        block = self.encoder.encode(headers, huffman=huffman)
        chunks = [block[i : i + max_frame] for i in range(0, len(block), max_frame)] or [b""]
        frames = []
        for index, chunk in enumerate(chunks):
            last = index == len(chunks) - 1
            flags = ["END_HEADERS"] if last else []
            frame = HeadersFrame(stream_id, flags=flags) if index == 0 else ContinuationFrame(stream_id, flags=flags)
            frame.data = chunk
            frames.append(frame.serialize())
        return stream_id, b"".join(frames)

    def connect_request(self, **extra: str) -> tuple[int, bytes]:
        return self.headers_frames([(":method", "CONNECT"), (":authority", f"{SERVER_IP}:8080"), *extra.items()])

    def wait_closed(self, timeout: float) -> str:
        """Read (and drop) whatever comes until the server closes; how it ended."""
        self.sock.settimeout(timeout)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if not self.sock.recv(1 << 20):
                    return "closed"
        except (ssl.SSLError, OSError) as e:
            if isinstance(e, TimeoutError):
                return "still open"
            return f"reset ({type(e).__name__})"
        return "still open"

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass

    def read_goaway(self, timeout: float = 10.0) -> GoAwayFrame | None:
        """Read frames until a GOAWAY (returned) or the end of the connection (None)."""
        self.sock.settimeout(timeout)
        try:
            while True:
                frame = self.read_frame()
                if isinstance(frame, GoAwayFrame):
                    return frame
        except (ConnectionError, ssl.SSLError, OSError):
            return None
