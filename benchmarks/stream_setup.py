"""Microbenchmark: what opening and ending one CONNECT stream costs in h2, per frame and side.

    python benchmarks/stream_setup.py           # best of 15 x 300 streams, µs per step
    python benchmarks/stream_setup.py --calls   # Python calls per step (a sys.setprofile hook)

Two h2 connections with ztwisted's HBONE configuration (``ztwisted.h2.connection._h2_connection``),
one client and one server, in memory; each stream goes through the steps of a short tunnel (the
CONNECT, its 200, each side's END_STREAM), each sent and received as
:class:`~ztwisted.h2.connection.HBONEConnection` does it: received bytes through the GOAWAY filter's
segments, and through :mod:`ztwisted.h2.lean_streams` where this install has it (otherwise through
``lean_data.receive`` and h2's ``send_headers``/``end_stream``, as before it). Run it with the Python
of the install to measure.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time

from ztwisted.h2.admission import let_h2_accept_any_number_of_streams
from ztwisted.h2.connection import _h2_connection
from ztwisted.h2.goaway import GoawayFilter

try:
    from ztwisted.h2 import lean_streams
except ImportError:  # an install from before the lean stream path
    lean_streams = None
    from ztwisted.h2 import lean_data

CONNECT = [(":method", "CONNECT"), (":authority", "10.0.0.2:8080"), ("forwarded", 'for="10.0.0.1"'), ("baggage", "k=v")]


class Side:
    def __init__(self, client: bool):
        self.h2 = _h2_connection(client)
        self.filter = GoawayFilter(expect_client_preface=not client, max_frame_size=1 << 20, max_header_block=1 << 20)

    def receive(self, data: bytes) -> list:
        if lean_streams is None:
            segments, _ = self.filter.segments(data, cut_out_data_frames=True)
            return lean_data.receive(self.h2, segments)
        segments, _ = self.filter.segments(data)
        return lean_streams.receive(self.h2, segments)

    def send_headers(self, stream_id: int, headers: list) -> None:
        if lean_streams is None:
            self.h2.send_headers(stream_id, headers)
        else:
            lean_streams.send_headers(self.h2, stream_id, headers)

    def end_stream(self, stream_id: int) -> None:
        if lean_streams is None:
            self.h2.end_stream(stream_id)
        else:
            lean_streams.end_stream(self.h2, stream_id)


def connected() -> tuple[Side, Side]:
    client, server = Side(True), Side(False)
    client.h2.initiate_connection()
    server.h2.initiate_connection()
    let_h2_accept_any_number_of_streams(server.h2)
    server.receive(client.h2.data_to_send())
    client.receive(server.h2.data_to_send())
    server.receive(client.h2.data_to_send())
    return client, server


def steps(client: Side, server: Side, stream_id: int) -> list[tuple[str, object]]:
    return [
        ("CONNECT sent (node-a)", lambda: client.send_headers(stream_id, CONNECT)),
        ("CONNECT received (node-b)", lambda: server.receive(client.h2.data_to_send())),
        ("200 sent (node-b)", lambda: server.send_headers(stream_id, [(":status", "200")])),
        ("200 received (node-a)", lambda: client.receive(server.h2.data_to_send())),
        ("END_STREAM sent (node-a)", lambda: client.end_stream(stream_id)),
        ("END_STREAM received (node-b)", lambda: server.receive(client.h2.data_to_send())),
        ("END_STREAM sent (node-b)", lambda: server.end_stream(stream_id)),
        ("END_STREAM received (node-a)", lambda: client.receive(server.h2.data_to_send())),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", action="store_true", help="count Python calls per step instead of timing")
    args = parser.parse_args()
    client, server = connected()
    stream_ids = iter(range(1, 2**31, 2))
    for _ in range(300):  # warm up, and fill HPACK's dynamic tables as a pooled connection has them
        for _, step in steps(client, server, next(stream_ids)):
            step()
    if args.calls:
        count_calls(client, server, stream_ids)
        return
    best: dict[str, float] = {}
    for _ in range(15):
        spent: collections.Counter = collections.Counter()
        for _ in range(300):
            for name, step in steps(client, server, next(stream_ids)):
                started = time.perf_counter()
                step()
                spent[name] += time.perf_counter() - started
        for name, seconds in spent.items():
            best[name] = min(best.get(name, seconds), seconds)
    for name, seconds in best.items():
        print(f"{name:30s} {seconds / 300 * 1e6:6.1f} µs")
    print(f"{'all of them':30s} {sum(best.values()) / 300 * 1e6:6.1f} µs (best of 15 x 300 streams each)")


def count_calls(client: Side, server: Side, stream_ids) -> None:
    calls: collections.Counter = collections.Counter()
    current = [""]

    def hook(frame, event, arg) -> None:
        if event == "call":
            calls[current[0]] += 1

    streams = 100
    for _ in range(streams):
        for name, step in steps(client, server, next(stream_ids)):
            current[0] = name
            sys.setprofile(hook)
            step()
            sys.setprofile(None)
    for name, count in calls.items():
        print(f"{name:30s} {count / streams - 1:6.1f} Python calls")  # less the step's own lambda
    print(f"{'all of them':30s} {sum(calls.values()) / streams - len(calls):6.1f} Python calls")


if __name__ == "__main__":
    main()
