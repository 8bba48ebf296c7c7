"""The per-connection record: istio_tcp_* metrics and one access-log event saying how it ended."""

from __future__ import annotations

import io
import json

import pytest
from twisted.internet import defer, task
from twisted.logger import globalLogPublisher

from ztwisted.hbone.tracking import ConnectionRecord, LiveConnections
from ztwisted.logs import json_observer
from ztwisted.metrics import ConnectionLabels, Metrics


class End:
    def __init__(self, sent=0, received=0):
        self.bytes_sent = sent
        self.bytes_received = received


@pytest.mark.parametrize(
    "outcomes, expected",
    [
        (("closed", "closed"), "closed"),
        (("reset", "drain-deadline"), "drain-deadline"),
        (("abrupt", "reset"), "abrupt"),
        (("reset by peer", "reset"), "reset by peer"),
    ],
)
def test_access_log_says_how_the_connection_ended(access_events, outcomes, expected):
    clock = task.Clock()
    metrics = Metrics()
    labels = ConnectionLabels(reporter="destination", destination_workload="echo")
    record = ConnectionRecord(metrics, clock, labels, **{"direction": "inbound", "dst.addr": "127.0.0.1:8080"})
    clock.advance(2.5)
    record.finish_when_done(defer.succeed(list(outcomes)), End(), End(sent=10, received=7))
    (event,) = access_events
    assert event["outcome"] == expected
    assert (event.get("error") is None) == (expected == "closed")
    assert event["duration"] == "2500ms"
    assert (event["bytes_sent"], event["bytes_recv"]) == (10, 7)
    # Istio's convention: received = what the client sent (towards the destination).
    assert metrics.sample("istio_tcp_received_bytes_total", labels.as_dict()) == 10
    assert metrics.sample("istio_tcp_sent_bytes_total", labels.as_dict()) == 7
    assert metrics.sample("istio_tcp_connections_closed_total", labels.as_dict()) == 1


def test_a_refused_connection_is_counted_with_its_flags(access_events):
    clock = task.Clock()
    metrics = Metrics()
    labels = ConnectionLabels(reporter="destination", destination_workload="echo")
    ConnectionRecord(metrics, clock, labels).refused("DENY", "denied by policy default/only-clients")
    (event,) = access_events
    assert event["outcome"] == "refused"
    assert event["error"] == "denied by policy default/only-clients"
    assert metrics.sample("istio_tcp_connections_closed_total", labels.with_flags("DENY").as_dict()) == 1


@pytest.mark.parametrize(
    "outcomes, ending",
    [
        (("closed", "closed"), ["duration", "src.forwarded", "outcome"]),
        (("reset", "drain-deadline"), ["duration", "src.forwarded", "outcome", "error"]),
    ],
)
def test_the_json_access_line_has_ztunnels_fields_in_its_order_then_the_others(outcomes, ending):
    out = io.StringIO()
    log_to = json_observer(out)
    globalLogPublisher.addObserver(log_to)
    try:
        clock = task.Clock()
        fields = {
            "direction": "inbound",
            "src.addr": "10.0.0.1:4000",
            "src.forwarded": "10.0.0.1:4000",
            "src.identity": "spiffe://cluster.local/ns/a/sa/client",
            "dst.addr": "10.0.0.2:8080",
            "dst.service": None,
            "dst.workload": "echo",
            "dst.identity": "spiffe://cluster.local/ns/b/sa/echo",
        }
        record = ConnectionRecord(Metrics(), clock, ConnectionLabels(reporter="destination"), **fields)
        clock.advance(0.012)
        record.finish_when_done(defer.succeed(list(outcomes)), End(), End(sent=10, received=7))
    finally:
        globalLogPublisher.removeObserver(log_to)
    (line,) = [json.loads(text) for text in out.getvalue().splitlines() if '"scope": "access"' in text]
    assert list(line) == [
        "time",
        "level",
        "scope",
        "message",
        "src.addr",
        "src.identity",
        "dst.addr",
        "dst.workload",
        "dst.identity",
        "direction",
        "bytes_sent",
        "bytes_recv",
        *ending,
    ]
    assert (line["bytes_sent"], line["bytes_recv"], line["duration"]) == (10, 7, "12ms")


def test_live_connections_tell_each_waiter_when_each_connection_ends():
    live = LiveConnections()
    first, second, gone = object(), object(), object()
    for protocol in (first, second, gone):
        live.add(protocol)
    live.remove(gone)  # ended before anyone waited
    assert len(live) == 2 and list(live) == [first, second]
    waits, more_waits = live.ended(), live.ended()
    assert len(waits) == len(more_waits) == 2
    live.remove(first)
    assert [w.called for w in waits + more_waits] == [True, False, True, False]
    live.remove(second)
    live.remove(second)  # twice: nothing more happens
    assert all(w.called for w in waits + more_waits)
    assert len(live) == 0 and live.ended() == []
