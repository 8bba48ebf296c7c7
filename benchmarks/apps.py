"""The apps at the far end of every benchmarked path: an echo and a counting sink.

Run as its own process (``python benchmarks/apps.py IP ECHO_PORT SINK_PORT``),
so its CPU use is separate from the client's. It prints ``ready`` once both
ports listen.

Sink protocol (no half-close needed, so every proxy carries it the same way):
the client sends an 8-byte big-endian length ``n`` and then ``n`` bytes; the
sink discards them and, once all ``n`` have arrived, answers with the same
8 bytes. The client's clock stops when that answer arrives.
"""

from __future__ import annotations

import asyncio
import struct
import sys

HEADER = struct.Struct("!Q")


class Echo(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data):
        self.transport.write(data)


class Sink(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport = transport
        self.header = b""
        self.expected: int | None = None
        self.received = 0

    def data_received(self, data):
        if self.expected is None:
            self.header += data
            if len(self.header) < HEADER.size:
                return
            (self.expected,) = HEADER.unpack_from(self.header)
            data = self.header[HEADER.size :]
        self.received += len(data)
        if self.received >= self.expected:
            self.transport.write(HEADER.pack(self.received))
            self.expected, self.header, self.received = None, b"", 0


async def serve(ip: str, echo_port: int, sink_port: int) -> None:
    loop = asyncio.get_running_loop()
    echo = await loop.create_server(Echo, ip, echo_port, backlog=1024, reuse_address=True)
    sink = await loop.create_server(Sink, ip, sink_port, backlog=1024, reuse_address=True)
    print("ready", flush=True)
    async with echo, sink:
        # Until the parent closes our stdin (or dies).
        await loop.run_in_executor(None, sys.stdin.read)


if __name__ == "__main__":
    address, echo_port, sink_port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    asyncio.run(serve(address, echo_port, sink_port))
