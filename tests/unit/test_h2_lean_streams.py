"""The lean path for stream setup and teardown (:mod:`ztwisted.h2.lean_streams`) against h2 alone.

Each test runs the same exchange twice, on a pair of h2 connections with ztwisted's HBONE
configuration: once through h2 alone, once as :class:`~ztwisted.h2.connection.HBONEConnection`
drives it (the GOAWAY filter's segments, :func:`lean_streams.receive`, :func:`lean_streams.send_headers`,
:func:`lean_streams.end_stream`), and compares the bytes sent, the events, the errors and h2's state.
"""

from __future__ import annotations

import h2.errors
import h2.events
import h2.exceptions
import h2.stream
import pytest
from hpack import NeverIndexedHeaderTuple
from hyperframe.frame import ContinuationFrame, DataFrame, HeadersFrame, RstStreamFrame

from ztwisted.h2 import lean_data, lean_streams
from ztwisted.h2.connection import _h2_connection
from ztwisted.h2.goaway import GoawayFilter

from .h2_support import parse_frames

CONNECT = [
    (":method", "CONNECT"),
    (":authority", "10.0.0.2:8080"),
    NeverIndexedHeaderTuple("forwarded", "for=10.0.0.1"),  # as ztwisted sends it: never indexed
    ("baggage", "k=v"),
]


class Side:
    """One end, h2 with ztwisted's configuration, driven through the lean path or h2 alone."""

    def __init__(self, client: bool, lean: bool):
        self.h2 = _h2_connection(client)
        self.lean = lean
        self.filter = GoawayFilter(expect_client_preface=False, max_frame_size=1 << 20, max_header_block=1 << 20)

    def feed(self, data: bytes) -> list[h2.events.Event]:
        if not self.lean:
            return self.h2.receive_data(data)
        segments, _ = self.filter.segments(data)
        return lean_streams.receive(self.h2, segments)

    def send_headers(self, stream_id: int, headers, end_stream: bool = False) -> None:
        if self.lean:
            lean_streams.send_headers(self.h2, stream_id, headers, end_stream)
        else:
            self.h2.send_headers(stream_id, headers, end_stream=end_stream)

    def end_stream(self, stream_id: int) -> None:
        if self.lean:
            lean_streams.end_stream(self.h2, stream_id)
        else:
            self.h2.end_stream(stream_id)


def connected(lean: bool) -> tuple[Side, Side]:
    """A pair whose connection is open: stream 1 was opened, answered and ended through h2 alone
    (h2 opens a connection with its first HEADERS; until then the lean paths leave everything to it)."""
    client, server = Side(True, lean), Side(False, lean)
    client.h2.initiate_connection()
    server.h2.initiate_connection()
    server.h2.receive_data(client.h2.data_to_send())
    client.h2.send_headers(1, CONNECT, end_stream=True)
    client.h2.receive_data(server.h2.data_to_send())
    server.h2.receive_data(client.h2.data_to_send())
    server.h2.send_headers(1, [(":status", "200")], end_stream=True)
    client.h2.receive_data(server.h2.data_to_send())
    server.h2.receive_data(client.h2.data_to_send())
    return client, server


def describe(events) -> list[tuple]:
    """What a handler reads of an event (stream_ended as the type of its event)."""
    return [
        (
            type(e).__name__,
            getattr(e, "stream_id", None),
            [(type(h).__name__, *h) for h in getattr(e, "headers", None) or ()],
            getattr(e, "data", None),
            type(getattr(e, "stream_ended", None)).__name__,
            repr(getattr(e, "error_code", None)),  # an ErrorCodes member, or an int for an unknown code
        )
        for e in events
    ]


def h2_state(side: Side) -> tuple:
    """The bookkeeping h2 keeps that the lean path touches."""
    conn = side.h2
    streams = {
        stream_id: (
            s.state_machine.state,
            s.state_machine.client,
            s.state_machine.headers_sent,
            s.state_machine.headers_received,
            s.state_machine.stream_closed_by,
            s._authority,
            s.request_method,
            s._expected_content_length,
            s._actual_content_length,
            s.outbound_flow_control_window,
            s._inbound_window_manager.current_window_size,
        )
        for stream_id, s in conn.streams.items()
    }
    return (
        conn.state_machine.state,
        conn.highest_inbound_stream_id,
        conn.highest_outbound_stream_id,
        conn.open_inbound_streams,
        conn.open_outbound_streams,
        streams,
        dict(conn._closed_streams),
        conn._inbound_flow_control_window_manager.current_window_size,
        conn.outbound_flow_control_window,
        len(conn.encoder.header_table.dynamic_entries),
        len(conn.decoder.header_table.dynamic_entries),
    )


def run(script, lean: bool) -> tuple[list, list, tuple, tuple]:
    """Run ``script(client, server, log)`` on a fresh pair; what was sent, the events, and both states."""
    client, server = connected(lean)
    wire, events = [], []

    def deliver(sender: Side, receiver: Side) -> None:
        data = sender.h2.data_to_send()
        wire.append(data)
        events.append(describe(receiver.feed(data)))

    script(client, server, deliver)
    return wire, events, h2_state(client), h2_state(server)


def both_ways(script) -> tuple:
    plain = run(script, lean=False)
    lean = run(script, lean=True)
    assert lean == plain
    return lean


def test_this_h2_has_what_the_lean_path_needs():
    assert lean_streams.ENABLED


@pytest.mark.parametrize("client_ends_first", [True, False])
def test_a_tunnels_life_is_the_same_bytes_events_and_state_as_h2(client_ends_first):
    def script(client, server, deliver):
        for stream_id in (3, 5, 7):  # HPACK's dynamic tables fill and are reused
            client.send_headers(stream_id, CONNECT)
            deliver(client, server)
            server.send_headers(stream_id, [(":status", "200")])
            deliver(server, client)
            first, second = (client, server) if client_ends_first else (server, client)
            first.end_stream(stream_id)
            deliver(first, second)
            second.end_stream(stream_id)
            deliver(second, first)

    wire, events, client_state, server_state = both_ways(script)
    assert [type(f).__name__ for f in parse_frames(wire[0])] == ["HeadersFrame"]
    received_types = [
        "NeverIndexedHeaderTuple" if isinstance(h, NeverIndexedHeaderTuple) else "HeaderTuple" for h in CONNECT
    ]
    assert events[0][0][:3] == (
        "RequestReceived",
        3,
        [(kind, *h) for kind, h in zip(received_types, CONNECT, strict=True)],
    )
    assert events[1][0][:3] == ("ResponseReceived", 3, [("HeaderTuple", ":status", "200")])
    assert [e[0] for e in events[2]] == ["DataReceived", "StreamEnded"]
    assert client_state[3:5] == (0, 0) and server_state[3:5] == (0, 0)  # all closed, and forgotten by h2


def test_the_lean_paths_take_the_plain_frames():
    client, server = connected(lean=True)
    for stream_id in (3, 5):
        client.send_headers(stream_id, CONNECT)
        assert lean_streams.take_headers_frame(server.h2, client.h2.data_to_send(), stream_id) is not None
        server.send_headers(stream_id, [(":status", "200")])
        assert lean_streams.take_headers_frame(client.h2, server.h2.data_to_send(), stream_id) is not None
        client.end_stream(stream_id)
        assert lean_data.take_data_frame(server.h2, client.h2.data_to_send(), stream_id) is not None
        server.end_stream(stream_id)
        assert lean_data.take_data_frame(client.h2, server.h2.data_to_send(), stream_id) is not None
    assert server.h2.streams[5].state_machine.state is h2.stream.StreamState.CLOSED


def test_a_refusal_and_data_around_the_end_are_the_same_as_h2():
    def script(client, server, deliver):
        client.send_headers(3, CONNECT)
        deliver(client, server)
        server.send_headers(3, [(":status", "503")], end_stream=True)  # refused: HEADERS with END_STREAM
        deliver(server, client)
        client.send_headers(5, CONNECT)
        deliver(client, server)
        server.send_headers(5, [(":status", "200")])
        client.h2.send_data(5, b"hello", end_stream=True)  # the last DATA carries END_STREAM
        deliver(client, server)
        deliver(server, client)
        server.h2.send_data(5, b"bye")
        server.end_stream(5)
        deliver(server, client)

    wire, events, _, _ = both_ways(script)
    assert [e[0] for e in events[1]] == ["ResponseReceived", "StreamEnded"]
    assert events[3][:1] == [("DataReceived", 5, [], b"hello", "StreamEnded", "None")]


# -- received headers: every check h2 makes still made ---------------------------------------------

REFUSED_REQUESTS = {
    "uppercase name": [*CONNECT, ("Forwarded", "x")],
    "space in a name": [*CONNECT, ("for warded", "x")],
    "control character in a name": [*CONNECT, ("a\x01b", "x")],
    "DEL in a name": [*CONNECT, ("a\x7fb", "x")],
    "non-ASCII name": [*CONNECT, ("caf\u00e9", "x")],
    "colon inside a name": [*CONNECT, ("a:b", "x")],
    "empty name": [*CONNECT, ("", "x")],
    "NUL in a value": [*CONNECT, ("a", "x\x00y")],
    "LF in a value": [*CONNECT, ("a", "x\ny")],
    "CR in a value": [*CONNECT, ("a", "x\ry")],
    "leading space in a value": [*CONNECT, ("a", " x")],
    "trailing tab in a value": [*CONNECT, ("a", "x\t")],
    "illegal character in :authority": [(":method", "CONNECT"), (":authority", "a\rb")],
    "connection header": [*CONNECT, ("connection", "close")],
    "keep-alive header": [*CONNECT, ("keep-alive", "5")],
    "transfer-encoding header": [*CONNECT, ("transfer-encoding", "chunked")],
    "upgrade header": [*CONNECT, ("upgrade", "h2c")],
    "te other than trailers": [*CONNECT, ("te", "gzip")],
    "duplicate :method": [(":method", "CONNECT"), (":method", "CONNECT"), (":authority", "a")],
    "duplicate :authority": [(":method", "CONNECT"), (":authority", "a"), (":authority", "a")],
    "duplicate :method, no :authority": [(":method", "CONNECT"), (":method", "CONNECT"), ("a", "b")],
    "pseudo-header after a field": [(":method", "CONNECT"), ("a", "b"), (":authority", "a")],
    "custom pseudo-header": [*CONNECT[:2], (":foo", "bar")],
    "response pseudo-header in a request": [*CONNECT[:2], (":status", "200")],
    "no :authority nor host": [(":method", "CONNECT"), ("a", "b")],
    "no :method": [(":authority", "a"), ("a", "b")],
    "CONNECT with :path": [*CONNECT[:2], (":path", "/")],
    "CONNECT with :scheme": [*CONNECT[:2], (":scheme", "https")],
    "GET without :path": [(":method", "GET"), (":authority", "a"), (":scheme", "https")],
    "host not matching :authority": [*CONNECT[:2], ("host", "elsewhere")],
    "two host headers": [(":method", "CONNECT"), ("host", "a"), ("host", "a")],
    "informational status in a request": [(":status", "100"), (":method", "CONNECT"), (":authority", "a")],
    "content-length not a number": [*CONNECT, ("content-length", "ten")],
}


def headers_frame(encoder, headers, stream_id: int = 3, flags=("END_HEADERS",)) -> bytes:
    """A HEADERS frame as any peer may send it (hyperframe's, not the lean path's)."""
    frame = HeadersFrame(stream_id, flags=flags)
    frame.data = encoder.encode([(n.encode(), v.encode()) for n, v in headers])
    return frame.serialize()


def stream_of(frame: bytes) -> int:
    """The stream id in a frame's header, as the GOAWAY filter hands it to the lean paths."""
    return int.from_bytes(frame[5:9], "big") & 0x7FFFFFFF


def take_headers(h2conn, frame: bytes):
    """:func:`~ztwisted.h2.lean_streams.take_headers_frame` with the frame's own stream id."""
    return lean_streams.take_headers_frame(h2conn, frame, stream_of(frame))


def request_block(headers, stream_id: int = 3, flags=("END_HEADERS",)) -> bytes:
    """A client's HEADERS frame, encoded with a fresh encoder (adding to the server's decoder's table
    only what it refers to itself)."""
    return headers_frame(_h2_connection(True).encoder, headers, stream_id, flags)


@pytest.mark.parametrize("case", sorted(REFUSED_REQUESTS))
def test_a_request_h2_refuses_is_refused_the_same_way(case):
    outcomes = []
    for lean in (False, True):
        client, server = connected(lean)
        with pytest.raises(h2.exceptions.ProtocolError) as raised:
            server.feed(request_block(REFUSED_REQUESTS[case]))
        outcomes.append((type(raised.value), server.h2.data_to_send(), server.h2.state_machine.state))
    assert outcomes[1] == outcomes[0]
    (goaway,) = parse_frames(outcomes[1][1])
    assert type(goaway).__name__ == "GoAwayFrame" and goaway.error_code == 1  # PROTOCOL_ERROR


ACCEPTED_BY_H2_BUT_NOT_PLAIN = {
    "te: trailers": [*CONNECT, ("te", "trailers")],
    "host matching :authority": [*CONNECT[:2], ("host", "10.0.0.2:8080")],
    "cookies (h2 joins them)": [*CONNECT, ("cookie", "a=1"), ("cookie", "b=2")],
    "content-length": [*CONNECT, ("content-length", "0")],
    "a control character in a value": [*CONNECT, ("a", "x\x01y")],
    "non-ASCII value": [*CONNECT, ("a", "caf\u00e9")],
    ":authority first": [CONNECT[1], CONNECT[0]],
    "empty value": [*CONNECT, ("a", "")],
    "extended CONNECT": [*CONNECT[:2], (":protocol", "websocket"), (":scheme", "https"), (":path", "/")],
    "GET": [(":method", "GET"), (":authority", "a"), (":scheme", "https"), (":path", "/")],
}


@pytest.mark.parametrize("case", sorted(ACCEPTED_BY_H2_BUT_NOT_PLAIN))
def test_a_request_h2_accepts_gives_the_same_event(case):
    results = [describe(connected(lean)[1].feed(request_block(ACCEPTED_BY_H2_BUT_NOT_PLAIN[case]))) for lean in (0, 1)]
    assert results[1] == results[0]
    assert results[1][0][0] == "RequestReceived"


def test_what_is_plain():
    raw = [(n.encode(), v.encode()) for n, v in CONNECT]
    assert lean_streams.plain_request(raw)
    assert lean_streams.plain_request(raw[:2] + [(b"a", b"")])
    assert not lean_streams.plain_request([(b":method", b"GET"), raw[1]])
    assert not lean_streams.plain_request(raw[:1])
    assert lean_streams.plain_response([(b":status", b"200"), (b"server", b"x")])
    for status in (b"100", b"20", b"2000", b"abc"):
        assert not lean_streams.plain_response([(b":status", status)])
    assert not lean_streams.plain_response([(b":status", b"200"), (b":status", b"200")])
    assert not lean_streams.plain_response([(b"server", b"x"), (b":status", b"200")])


REFUSED_RESPONSES = {
    "request pseudo-header": [(":status", "200"), (":method", "CONNECT")],
    "no :status": [("server", "x")],
    "duplicate :status": [(":status", "200"), (":status", "200")],
    "uppercase name": [(":status", "200"), ("Server", "x")],
    "CR in a value": [(":status", "200"), ("server", "a\rb")],
    "connection header": [(":status", "200"), ("connection", "close")],
}


def respond(client: Side, server: Side, headers) -> bytes:
    client.send_headers(3, CONNECT)
    server.feed(client.h2.data_to_send())
    return headers_frame(server.h2.encoder, headers)


@pytest.mark.parametrize("case", sorted(REFUSED_RESPONSES))
def test_a_response_h2_refuses_is_refused_the_same_way(case):
    outcomes = []
    for lean in (False, True):
        client, server = connected(lean)
        with pytest.raises(h2.exceptions.ProtocolError) as raised:
            client.feed(respond(client, server, REFUSED_RESPONSES[case]))
        outcomes.append((type(raised.value), client.h2.data_to_send()))
    assert outcomes[1] == outcomes[0]


def test_an_informational_response_then_the_final_one_are_the_same_as_h2():
    results = []
    for lean in (False, True):
        client, server = connected(lean)
        block = respond(client, server, [(":status", "100")])
        events = client.feed(block)
        server.send_headers(3, [(":status", "200")])
        results.append(describe(events + client.feed(server.h2.data_to_send())))
    assert results[1] == results[0]
    assert [e[0] for e in results[1]] == ["InformationalResponseReceived", "ResponseReceived"]


def test_a_header_list_over_the_limit_is_refused_as_h2_refuses_it():
    outcomes = []
    for lean in (False, True):
        client, server = connected(lean)
        server.h2.decoder.max_header_list_size = 1000  # as SETTINGS_MAX_HEADER_LIST_SIZE, once acknowledged
        with pytest.raises(h2.exceptions.DenialOfServiceError):
            server.feed(request_block([*CONNECT, ("big", "x" * 1000)]))
        outcomes.append(server.h2.data_to_send())
    assert outcomes[1] == outcomes[0]


# -- frames and states left to h2 ---------------------------------------------------------------------


def test_headers_frames_left_to_h2():
    client, server = connected(lean=True)
    take = take_headers
    assert take(server.h2, request_block(CONNECT, flags=("END_HEADERS", "END_STREAM"))) is None
    assert take(server.h2, request_block(CONNECT, flags=())) is None  # CONTINUATION follows
    priority = HeadersFrame(3, flags=["END_HEADERS", "PRIORITY"], data=b"\x82")
    assert take(server.h2, priority.serialize()) is None
    padded = HeadersFrame(3, flags=["END_HEADERS", "PADDED"], data=b"\x82", pad_length=2)
    assert take(server.h2, padded.serialize()) is None
    assert take(server.h2, request_block(CONNECT, stream_id=4)) is None  # a server's ID from a client
    assert take(server.h2, request_block(CONNECT, stream_id=3)) is not None
    assert take(server.h2, request_block(CONNECT, stream_id=3)) is None  # trailers on an open stream
    # An ID below the highest (a stream opened later came first): h2 decides what it is.
    server.feed(request_block(CONNECT, stream_id=9))
    assert take(server.h2, request_block(CONNECT, stream_id=7)) is None
    # A frame h2 is partway through: what follows reaches h2 after it.
    server.h2.receive_data(request_block(CONNECT, stream_id=11)[:5])
    assert take(server.h2, request_block(CONNECT, stream_id=13)) is None


def test_headers_left_to_h2_on_the_client_and_when_closed():
    client, server = connected(lean=True)
    take = take_headers
    assert take(client.h2, request_block([(":status", "200")], stream_id=3)) is None  # no such stream
    client.send_headers(3, CONNECT)
    server.feed(client.h2.data_to_send())
    server.send_headers(3, [(":status", "200")])
    assert take(client.h2, server.h2.data_to_send()) is not None
    assert take(client.h2, request_block([("trailer", "x")], stream_id=3)) is None  # trailers: h2's
    client.send_headers(5, CONNECT)
    server.feed(client.h2.data_to_send())
    server.send_headers(5, [(":status", "200")])
    client.h2._terminate_connection(0)  # h2 closed the connection (its GOAWAY queued)
    assert take(client.h2, server.h2.data_to_send()) is None


def test_too_many_streams_is_h2s_error():
    outcomes = []
    for lean in (False, True):
        client, server = connected(lean)
        server.h2.local_settings.max_concurrent_streams = 1
        server.h2.local_settings.acknowledge()
        server.feed(request_block(CONNECT, stream_id=3))
        with pytest.raises(h2.exceptions.TooManyStreamsError):
            server.feed(request_block(CONNECT, stream_id=5))
        outcomes.append(server.h2.data_to_send())
    assert outcomes[1] == outcomes[0]


def test_resets_around_the_lean_frames_are_the_same_as_h2():
    def script(client, server, deliver):
        client.send_headers(3, CONNECT)
        deliver(client, server)
        server.h2.reset_stream(3, 8)  # refused after it was taken
        deliver(server, client)
        client.send_headers(5, CONNECT)
        client.h2.reset_stream(5, 8)  # a CONNECT and its reset in one read
        deliver(client, server)
        with pytest.raises(h2.exceptions.StreamClosedError):  # h2 closed it: nothing is answered
            server.send_headers(5, [(":status", "200")])
        deliver(server, client)

    wire, events, _, server_state = both_ways(script)
    assert [e[0] for e in events[2]] == ["RequestReceived", "StreamReset"]


# -- sending: what goes to h2 -------------------------------------------------------------------------


def sent_the_same(action) -> None:
    """``action(side)`` on a connected pair, lean and not: the same bytes, or the same exception, and state."""
    outcomes = []
    for lean in (False, True):
        client, server = connected(lean)
        try:
            action(client, server)
            error = None
        except Exception as e:  # noqa: BLE001 - compared between the two paths
            error = (type(e), str(e))
        outcomes.append((error, client.h2.data_to_send(), server.h2.data_to_send(), h2_state(client), h2_state(server)))
    assert outcomes[1] == outcomes[0]


@pytest.mark.parametrize(
    "action",
    [
        pytest.param(lambda c, s: c.send_headers(3, CONNECT, end_stream=True), id="request with END_STREAM"),
        pytest.param(lambda c, s: c.send_headers(4, CONNECT), id="client on an even ID"),
        pytest.param(lambda c, s: (c.send_headers(5, CONNECT), c.send_headers(3, CONNECT)), id="ID too low"),
        pytest.param(lambda c, s: (c.send_headers(3, CONNECT), c.send_headers(3, [("x", "y")])), id="trailers"),
        pytest.param(lambda c, s: s.send_headers(4, [(":status", "200")]), id="server opens a stream"),
        pytest.param(lambda c, s: s.send_headers(3, [(":status", "200")]), id="server on an unknown stream"),
        pytest.param(lambda c, s: (c.h2._terminate_connection(0), c.send_headers(3, CONNECT)), id="closed"),
        pytest.param(lambda c, s: c.end_stream(3), id="END_STREAM on an unknown stream"),
        pytest.param(lambda c, s: (c.send_headers(3, CONNECT), c.end_stream(3), c.end_stream(3)), id="ended twice"),
        pytest.param(
            lambda c, s: (c.send_headers(3, CONNECT), c.h2.reset_stream(3), c.end_stream(3)),
            id="END_STREAM after reset",
        ),
    ],
)
def test_sends_left_to_h2(action):
    sent_the_same(action)


@pytest.mark.parametrize(
    "responses",
    [
        [[(":status", "100")], [(":status", "200")]],
        [[(":status", "200")], [(":status", "200")]],
        [[(":status", "200")], [("trailer", "x")]],
        [[(":status", "403")]],
    ],
    ids=["informational then final", "two responses", "trailers without END_STREAM", "refusal"],
)
def test_responses_sent_are_the_same_as_h2(responses):
    def action(client, server):
        client.send_headers(3, CONNECT)
        server.feed(client.h2.data_to_send())
        for headers in responses:
            server.send_headers(3, headers, end_stream=headers[0][1] == "403")

    sent_the_same(action)


def test_a_block_over_the_frame_size_is_cut_into_continuation_frames_as_h2_cuts_it():
    big = [*CONNECT, ("x-big", "y" * 40000)]

    def script(client, server, deliver):
        client.send_headers(3, big)
        deliver(client, server)
        server.send_headers(3, [(":status", "200"), ("x-big", "z" * 40000)], end_stream=True)
        deliver(server, client)

    wire, events, _, _ = both_ways(script)
    assert [type(f) for f in parse_frames(wire[0])] == [HeadersFrame, ContinuationFrame, ContinuationFrame]
    assert events[0][0][0] == "RequestReceived"


def test_gated_off_everything_goes_to_h2(monkeypatch):
    client, server = connected(lean=True)
    monkeypatch.setattr(lean_streams, "ENABLED", False)
    called = []
    for name in ("send_headers", "end_stream"):
        method = getattr(client.h2, name)
        monkeypatch.setattr(client.h2, name, lambda *a, _m=method, _n=name, **k: (called.append(_n), _m(*a, **k)))
    client.send_headers(3, CONNECT)
    sent = client.h2.data_to_send()
    assert lean_streams.take_headers_frame(server.h2, sent, 3) is None
    client.end_stream(3)
    assert called == ["send_headers", "end_stream"]


@pytest.mark.parametrize("option", ["validate_outbound_headers", "normalize_outbound_headers"])
def test_headers_h2_is_asked_to_check_or_normalize_go_to_h2(option):
    """Only with HBONE's configuration (ztwisted's own headers sent as they are) is a send lean."""

    def action(client, server):
        setattr(client.h2.config, option, True)
        client.send_headers(3, [*CONNECT, ("Connection", "close")])

    sent_the_same(action)


def test_an_end_stream_short_of_the_content_length_is_h2s_error():
    outcomes = []
    for lean in (False, True):
        client, server = connected(lean)
        server.feed(request_block([*CONNECT, ("content-length", "10")]))
        server.send_headers(3, [(":status", "200")])
        server.feed(DataFrame(3, data=b"x" * 5).serialize())
        with pytest.raises(h2.exceptions.InvalidBodyLengthError):
            server.feed(DataFrame(3, data=b"y", flags=["END_STREAM"]).serialize())
        outcomes.append(server.h2.data_to_send())
    assert outcomes[1] == outcomes[0]


def test_a_padded_data_frame_is_left_to_h2():
    client, server = connected(lean=True)
    server.feed(request_block(CONNECT))
    padded = DataFrame(3, data=b"x", flags=["END_STREAM", "PADDED"], pad_length=3)
    assert lean_data.take_data_frame(server.h2, padded.serialize(), 3) is None
    assert describe(server.feed(padded.serialize()))[0][3:5] == (b"x", "StreamEnded")


def test_a_response_to_head_expects_no_body_as_in_h2():
    """Not a CONNECT (ztwisted sends none), but h2's content-length rule for it is kept."""

    def action(client, server):
        client.send_headers(3, [(":method", "HEAD"), (":authority", "a"), (":scheme", "https"), (":path", "/")])
        server.feed(client.h2.data_to_send())
        server.send_headers(3, [(":status", "200")])
        server.h2.send_data(3, b"x")
        client.feed(server.h2.data_to_send())

    sent_the_same(action)


def test_a_response_on_a_stream_reset_while_opening_is_answered_as_h2_answers_it():
    """The SOCKS5 client left while its tunnel opened (``Stream._cancel_opening``): the 200 finds
    the stream closed by our RST_STREAM, and h2 resets it again (STREAM_CLOSED)."""

    def script(client, server, deliver):
        client.send_headers(3, CONNECT)
        deliver(client, server)
        server.send_headers(3, [(":status", "200")])
        client.h2.reset_stream(3, 8)
        deliver(server, client)
        deliver(client, server)

    wire, events, client_state, _ = both_ways(script)
    assert events[1] == []
    assert [type(f).__name__ for f in parse_frames(wire[2])] == ["RstStreamFrame", "RstStreamFrame"]


def test_a_headers_frame_over_h2s_maximum_frame_size_is_h2s_error():
    """The GOAWAY filter allows our announced size; h2 enforces its own until the peer acknowledged it."""
    outcomes = []
    for lean in (False, True):
        client, server = connected(lean)
        block = request_block([*CONNECT, ("x-big", "y" * 17000)])
        assert lean_streams.take_headers_frame(server.h2, block, 3) is None
        with pytest.raises(h2.exceptions.FrameTooLargeError):
            server.feed(block)
        outcomes.append(server.h2.data_to_send())
    assert outcomes[1] == outcomes[0]


# -- RST_STREAM -----------------------------------------------------------------------------------------


class Resetting(Side):
    """A side that resets through the lean path (or h2 alone)."""

    def reset_stream(self, stream_id: int, code: int) -> None:
        if self.lean:
            lean_streams.reset_stream(self.h2, stream_id, code)
        else:
            self.h2.reset_stream(stream_id, code)


def rst(stream_id: int, code: int) -> bytes:
    return RstStreamFrame(stream_id, error_code=code).serialize()


@pytest.mark.parametrize(
    ("opened", "resetting_side"),
    [
        ("open", "client"),
        ("open", "server"),
        ("client ended", "client"),  # half-closed (local) on the client, (remote) on the server
        ("client ended", "server"),
        ("server ended", "client"),
    ],
)
def test_resets_sent_and_received_are_the_same_as_h2(opened, resetting_side, monkeypatch):
    monkeypatch.setattr(Side, "reset_stream", Resetting.reset_stream, raising=False)

    def script(client, server, deliver):
        client.send_headers(3, CONNECT)
        deliver(client, server)
        server.send_headers(3, [(":status", "200")])
        deliver(server, client)
        if opened == "client ended":
            client.end_stream(3)
            deliver(client, server)
        elif opened == "server ended":
            server.end_stream(3)
            deliver(server, client)
        sender, receiver = (client, server) if resetting_side == "client" else (server, client)
        sender.reset_stream(3, 8)
        deliver(sender, receiver)

    wire, events, client_state, server_state = both_ways(script)
    assert [type(f).__name__ for f in parse_frames(wire[-1])] == ["RstStreamFrame"]
    assert events[-1] == [("StreamReset", 3, [], None, "NoneType", repr(h2.errors.ErrorCodes.CANCEL))]


def test_the_lean_paths_take_plain_resets():
    client, server = connected(lean=True)
    client.send_headers(3, CONNECT)
    server.feed(client.h2.data_to_send())
    lean_streams.reset_stream(client.h2, 3, 0x1234)  # an unknown code is sent and received as an int
    (event,) = lean_streams.take_rst_stream_frame(server.h2, client.h2.data_to_send(), 3)
    assert (event.stream_id, event.error_code, event.remote_reset) == (3, 0x1234, True)
    assert server.h2.streams[3].state_machine.stream_closed_by is h2.stream.StreamClosedBy.RECV_RST_STREAM


@pytest.mark.parametrize(
    "frame",
    [
        pytest.param(lambda: rst(3, 8), id="on a closed stream"),  # reset once already below
        pytest.param(lambda: rst(7, 8), id="on an idle stream"),
        pytest.param(lambda: rst(5, 8)[:-1], id="too short: h2's FRAME_SIZE_ERROR"),
        pytest.param(lambda: bytes([0, 0, 5]) + rst(5, 8)[3:] + b"\x00", id="too long"),
    ],
)
def test_resets_left_to_h2_are_handled_as_h2_handles_them(frame):
    outcomes = []
    for lean in (False, True):
        client, server = connected(lean)
        for stream_id in (3, 5):
            client.send_headers(stream_id, CONNECT)
            server.feed(client.h2.data_to_send())
        server.feed(rst(3, 8))
        if lean:
            assert lean_streams.take_rst_stream_frame(server.h2, frame(), stream_of(frame())) is None
        try:
            outcome = describe(server.feed(frame()))
        except h2.exceptions.ProtocolError as e:
            outcome = type(e)
        outcomes.append((outcome, server.h2.data_to_send(), h2_state(server)))
    assert outcomes[1] == outcomes[0]


@pytest.mark.parametrize(
    "action",
    [
        pytest.param(lambda c: c.reset_stream(3, 8), id="unknown stream"),
        pytest.param(lambda c: (c.send_headers(3, CONNECT), c.reset_stream(3, 8), c.reset_stream(3, 8)), id="twice"),
        pytest.param(lambda c: (c.send_headers(3, CONNECT), c.reset_stream(3, -1)), id="a code out of range"),
        pytest.param(
            lambda c: (c.send_headers(3, CONNECT), c.h2._terminate_connection(0), c.reset_stream(3, 8)),
            id="closed connection",
        ),
    ],
)
def test_resets_sent_through_h2(action, monkeypatch):
    monkeypatch.setattr(Side, "reset_stream", Resetting.reset_stream, raising=False)
    sent_the_same(lambda client, server: action(client))


@pytest.mark.parametrize("split", [None, 1, 9, -5], ids=["one read", "a byte", "a frame header", "near the end"])
def test_a_headers_frame_inside_another_streams_header_block_is_h2s_error(split):
    # HEADERS of stream 3 without END_HEADERS, then a whole HEADERS of stream 5: the second does not
    # start a block of its own (RFC 9113 section 6.10), so it is not plain, and h2 refuses it.
    data = request_block(CONNECT, 3, flags=()) + request_block(CONNECT, 5)
    reads = [data] if split is None else [data[:split], data[split:]]
    if split is not None and split < 0:
        reads = [data[: len(data) + split], data[len(data) + split :]]
    outcomes = []
    for lean in (False, True):
        client, server = connected(lean)
        with pytest.raises(h2.exceptions.ProtocolError) as raised:
            for read in reads:
                server.feed(read)
        outcomes.append((type(raised.value), server.h2.data_to_send(), server.h2.state_machine.state))
    assert outcomes[1] == outcomes[0]


def test_the_filter_does_not_cut_out_a_headers_frame_inside_another_block():
    segments, _ = GoawayFilter(False, 1 << 20, 1 << 20).segments(
        request_block(CONNECT, 3, flags=()) + request_block(CONNECT, 5)
    )
    assert [stream_id for _, stream_id in segments] == [0]


def test_a_headers_frame_while_h2_holds_part_of_a_header_block_is_left_to_h2():
    client, server = connected(lean=True)
    server.h2.receive_data(request_block(CONNECT, 3, flags=()))  # h2 now holds an open header block
    assert lean_streams.take_headers_frame(server.h2, request_block(CONNECT, 5), 5) is None


def test_the_filter_cuts_out_the_frames_the_lean_paths_take():
    client, server = connected(lean=True)
    client.send_headers(3, CONNECT)
    client.h2.send_data(3, b"x")
    client.end_stream(3)
    lean_streams.reset_stream(client.h2, 3, 8)
    data = client.h2.data_to_send()
    segments, _ = GoawayFilter(False, 1 << 20, 1 << 20).segments(data)
    assert [(bytes(segment)[3], stream_id) for segment, stream_id in segments] == [(1, 3), (0, 3), (0, 3), (3, 3)]


def test_a_whole_segment_of_another_kind_goes_to_h2():
    # Only DATA, HEADERS and RST_STREAM are taken; a 13-byte WINDOW_UPDATE handed over as a whole
    # frame is h2's, not read as a reset.
    client, server = connected(lean=True)
    client.send_headers(3, CONNECT)
    server.feed(client.h2.data_to_send())
    client.h2.increment_flow_control_window(100, stream_id=3)
    update = client.h2.data_to_send()
    assert len(update) == 13
    (event,) = lean_streams.receive(server.h2, [(update, True)])
    assert isinstance(event, h2.events.WindowUpdated)
    assert server.h2.streams[3].state_machine.state is h2.stream.StreamState.OPEN
