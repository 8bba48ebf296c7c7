"""Tests for the log observers and the access log."""

from __future__ import annotations

import io
import ipaddress
import json
import re

import pytest
from twisted.logger import Logger, LogLevel, formatEvent, textFileLogObserver
from twisted.logger._legacy import publishToNewObserver
from twisted.python.log import textFromEventDict

from ztwisted.logs import (
    _FIELDS_KEY,
    ACCESS_FIELDS,
    access_log,
    event_as_flat_dict,
    json_observer,
    observer_for,
    text_observer,
)

RFC3339_UTC_MICROS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$")


def json_lines(buf: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in buf.getvalue().splitlines()]


def test_json_observer_writes_flat_objects():
    buf = io.StringIO()
    log = Logger(namespace="ztwisted.node", observer=json_observer(buf))
    marker = object()
    log.info("workload {uid} added", uid="w1", count=3, tags=["a"], obj=marker, ratio=float("nan"))
    log.warn("second")  # noqa: G010 - twisted.logger's name for the level
    first, second = json_lines(buf)
    assert RFC3339_UTC_MICROS.match(first["time"])
    assert first["level"] == "info"
    assert first["scope"] == "ztwisted.node"
    assert first["message"] == "workload w1 added"
    assert first["uid"] == "w1" and first["count"] == 3 and first["tags"] == ["a"]
    assert first["obj"] == str(marker)
    assert first["ratio"] == "nan"
    assert not any(key.startswith("log_") for key in first)
    assert "error" not in first
    assert second["level"] == "warn" and second["message"] == "second"


def test_json_time_is_utc_with_microseconds():
    buf = io.StringIO()
    json_observer(buf)({"log_time": 86400.25, "log_format": "x", "log_level": LogLevel.debug, "log_namespace": "n"})
    (line,) = json_lines(buf)
    assert line["time"] == "1970-01-02T00:00:00.250000Z"
    assert line["level"] == "debug"


def test_json_failure_adds_traceback_as_error():
    buf = io.StringIO()
    log = Logger(namespace="ztwisted.x", observer=json_observer(buf))
    try:
        raise ZeroDivisionError("division by zero")
    except ZeroDivisionError:
        log.failure("computing {what} failed", what="ratio")
    (line,) = json_lines(buf)
    assert line["level"] == "critical"
    assert line["message"] == "computing ratio failed"
    assert "Traceback" in line["error"] and "ZeroDivisionError" in line["error"]


def test_json_legacy_event_has_no_duplicate_keys():
    buf = io.StringIO()
    publishToNewObserver(
        json_observer(buf),
        {"message": ("hello", "world"), "isError": 0, "system": "tcp", "time": 1.0},
        textFromEventDict,
    )
    (line,) = json_lines(buf)
    assert line["message"] == "hello world"
    assert line["scope"] == "log_legacy"
    assert line["system"] == "tcp"
    assert "isError" not in line
    assert line["time"] == "1970-01-01T00:00:01.000000Z"


def test_text_observer_plain_event_has_no_fields():
    buf = io.StringIO()
    log = Logger(namespace="ztwisted.node", observer=text_observer(buf))
    log.info("hello {who}", who="you", extra="not shown")
    line = buf.getvalue()
    assert line.endswith("[ztwisted.node#info] hello you\n")
    assert "extra=" not in line


def test_text_observer_appends_access_fields():
    buf = io.StringIO()
    log = Logger(namespace="ztwisted.hbone", observer=text_observer(buf))
    access_log(
        log,
        src_addr="10.0.0.1:4000",
        dst_addr="10.0.0.2:80",
        dst_hbone_addr="10.0.0.2:80",
        src_workload=None,
        direction="outbound",
        bytes_sent=10,
        bytes_recv=20,
        duration=0.0123,
        **{"dst.service": "echo.default.svc.cluster.local"},
        note="a b",
    )
    line = buf.getvalue()
    assert line.count("\n") == 1
    assert "[access#info] connection complete " in line
    assert line.endswith(
        " connection complete src.addr=10.0.0.1:4000 dst.addr=10.0.0.2:80 "
        "dst.hbone_addr=10.0.0.2:80 dst.service=echo.default.svc.cluster.local "
        'direction=outbound bytes_sent=10 bytes_recv=20 duration=12ms note="a b"\n'
    )


def test_access_log_event_shape():
    events: list[dict] = []
    log = Logger(namespace="ztwisted.hbone.inbound", observer=events.append)
    access_log(
        log,
        **{"src.addr": "1.2.3.4:5", "src.identity": "spiffe://cluster.local/ns/a/sa/b"},
        direction="inbound",
        bytes_sent=1,
        bytes_recv=2,
        duration="7ms",
    )
    (event,) = events
    assert event["log_namespace"] == "access"
    assert event["log_level"] is LogLevel.info
    # The text carries the fields, for any text observer (twistd's own when --log-format text).
    assert formatEvent(event) == (
        "connection complete src.addr=1.2.3.4:5 src.identity=spiffe://cluster.local/ns/a/sa/b"
        " direction=inbound bytes_sent=1 bytes_recv=2 duration=7ms"
    )
    fields = [key for key in event if not key.startswith("log_")]
    assert fields == ["src.addr", "src.identity", "direction", "bytes_sent", "bytes_recv", "duration"]
    assert all(key in ACCESS_FIELDS for key in fields)
    assert event["duration"] == "7ms"


def test_access_log_with_error_is_error_level_and_json_keys_keep_dots():
    buf = io.StringIO()
    log = Logger(observer=json_observer(buf))
    access_log(
        log,
        src_addr="10.0.0.1:4000",
        dst_addr="10.0.0.2:15008",
        dst_hbone_addr="10.0.0.3:8080",
        dst_identity="spiffe://cluster.local/ns/d/sa/s",
        direction="outbound",
        bytes_sent=0,
        bytes_recv=0,
        duration=1.5,
        error="connection refused",
    )
    (line,) = json_lines(buf)
    assert line["level"] == "error"
    assert line["scope"] == "access"
    assert line["message"] == "connection complete"
    assert line["src.addr"] == "10.0.0.1:4000"
    assert line["dst.hbone_addr"] == "10.0.0.3:8080"
    assert line["dst.identity"] == "spiffe://cluster.local/ns/d/sa/s"
    assert line["bytes_sent"] == 0
    assert line["duration"] == "1500ms"
    assert line["error"] == "connection refused"


@pytest.mark.parametrize("error", [None, "connection refused"])
def test_access_log_json_takes_the_fields_as_the_generic_path_does(error):
    """The JSON observer writes an access-log event from its ordered fields (without walking
    the event's own keys): the same keys, values and order as from the event itself."""
    events: list[dict] = []
    access_log(
        Logger(namespace="access", observer=events.append),
        direction="outbound",
        src_addr="10.0.0.1:4000",
        dst_identity="spiffe://cluster.local/ns/d/sa/s",
        bytes_sent=3,
        bytes_recv=True,
        duration=0.25,
        error=error,
        outcome=ipaddress.ip_address("10.0.0.9"),  # not a JSON value: rendered the generic way too
        extra=1.5,
    )
    (event,) = events
    fast = event_as_flat_dict(event)
    generic_event = dict(event)
    del generic_event[_FIELDS_KEY]
    generic = event_as_flat_dict(generic_event)
    assert list(fast.items()) == list(generic.items())
    assert list(fast)[4:7] == ["src.addr", "dst.identity", "direction"]
    assert fast["outcome"] == "10.0.0.9" and fast["extra"] == 1.5
    assert ("error" in fast) == (error is not None)


def test_access_log_through_a_logger_of_another_namespace_is_in_the_access_namespace():
    events: list[dict] = []
    source = object()
    access_log(Logger(namespace="ztwisted.elsewhere", source=source, observer=events.append), direction="inbound")
    (event,) = events
    assert event["log_namespace"] == "access"
    assert event["log_source"] is source


def test_an_access_log_event_is_the_one_loggers_emit_makes():
    # access_log builds the event itself (without emit's check of the level): the same keys,
    # in the same order, and the same values.
    events: list[dict] = []
    log = Logger(namespace="access", source=object(), observer=events.append)
    access_log(log, src_addr="10.0.0.1:4000", direction="inbound", bytes_sent=3, error="reset")
    (made,) = events
    fields = made["log_access_fields"]
    log.emit(
        LogLevel.error,
        made["log_format"],
        log_brief=made["log_brief"],
        log_access_text=made["log_access_text"],
        log_access_fields=fields,
        **fields,
    )
    emitted = events[1]
    assert list(made) == list(emitted)
    assert {k: v for k, v in made.items() if k != "log_time"} == {k: v for k, v in emitted.items() if k != "log_time"}
    assert made["log_level"] is LogLevel.error and made["log_logger"] is log
    assert abs(made["log_time"] - emitted["log_time"]) < 60


def test_access_log_text_survives_braces_and_twisteds_own_text_observer():
    buf = io.StringIO()
    log = Logger(namespace="x", observer=textFileLogObserver(buf))
    access_log(log, src_addr="10.0.0.1:4000", direction="inbound", error="bad authority '{x}'")
    assert buf.getvalue().endswith(
        """[access#error] connection complete src.addr=10.0.0.1:4000 direction=inbound error="bad authority '{x}'"\n"""
    )


def test_access_log_rejects_bad_direction():
    with pytest.raises(ValueError, match="direction must be 'inbound' or 'outbound'"):
        access_log(Logger(observer=lambda e: None), direction="sideways")


def test_observer_for():
    buf = io.StringIO()
    Logger(namespace="n", observer=observer_for("json", buf)).info("x")
    assert json_lines(buf)[0]["message"] == "x"
    buf = io.StringIO()
    Logger(namespace="n", observer=observer_for("text", buf)).info("x")
    assert buf.getvalue().endswith("[n#info] x\n")
    with pytest.raises(ValueError, match="unknown log format 'xml': expected 'json' or 'text'"):
        observer_for("xml", buf)
