"""Log output: JSON lines or Twisted text, and ztunnel-style access-log events.

An access-log event has namespace ``access``, the message "connection
complete" and ztunnel's field names (``src.addr``, ``dst.hbone_addr``,
``bytes_sent``...). Its level is info, or error when an ``error`` is given
(as ztunnel does). Its text is the message followed by ``key=value`` for each
field, so that any text observer (twistd's own included) shows the fields;
the JSON observer writes the bare message and the fields as keys.
"""

from __future__ import annotations

import functools
import json
import re
import time
from collections.abc import Callable
from typing import IO, Any

import attrs
from twisted.logger import (
    ILogObserver,
    Logger,
    LogLevel,
    formatEvent,
    formatEventAsClassicLogText,
)
from zope.interface import implementer

ACCESS_NAMESPACE = "access"
ACCESS_MESSAGE = "connection complete"

# ztunnel's access-log fields, in its order.
ACCESS_FIELDS = (
    "src.addr",
    "src.workload",
    "src.namespace",
    "src.identity",
    "dst.addr",
    "dst.hbone_addr",
    "dst.service",
    "dst.workload",
    "dst.namespace",
    "dst.identity",
    "direction",
    "bytes_sent",
    "bytes_recv",
    "duration",
    "error",
)

_CORE_KEYS = ("time", "level", "scope", "message", "error")
# An event's message without the fields its text repeats (access-log events), for the JSON observer.
_BRIEF_KEY = "log_brief"
# The callable that renders an access-log event's text (its format is just a call of it).
_TEXT_KEY = "log_access_text"
# An access-log event's fields, in ztunnel's order: what the JSON observer writes of it.
_FIELDS_KEY = "log_access_fields"
# Values JSON writes as they are (exact types: a subclass may render differently).
_PLAIN_TYPES = frozenset({str, int, bool, type(None)})
# Keys a twisted.python.log (legacy) event carries that formatEvent already used.
_LEGACY_KEYS = frozenset({"message", "format", "isError", "failure", "why", "time"})


@functools.lru_cache(maxsize=4)
def _rfc3339_second(seconds: int) -> str:
    # Events come in time order: a handful of seconds cover them, and strftime runs once per second.
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))


def _rfc3339(timestamp: float | None) -> str:
    """RFC 3339 UTC with microseconds, e.g. ``2024-05-01T12:00:00.123456Z``."""
    micros = round((time.time() if timestamp is None else timestamp) * 1_000_000)
    seconds, micro = divmod(micros, 1_000_000)
    return _rfc3339_second(seconds) + f".{micro:06d}Z"


def _message(event: dict[str, Any]) -> str:
    """``formatEvent(event)``, without parsing a format that has no fields (the access log's)."""
    fmt = event.get("log_format")
    if isinstance(fmt, str) and "{" not in fmt and "}" not in fmt and "log_flattened" not in event:
        return fmt
    return formatEvent(event)


def _jsonable(value: Any) -> Any:
    if value.__class__ in _PLAIN_TYPES or isinstance(value, (str, bool, int)):
        return value
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return str(value)
    return value


def _level_name(event: dict[str, Any]) -> str:
    return getattr(event.get("log_level"), "name", "info")


def event_as_flat_dict(event: dict[str, Any]) -> dict[str, Any]:
    """The flat object the JSON observer writes for ``event``."""
    flat: dict[str, Any] = {
        "time": _rfc3339(event.get("log_time")),
        "level": _level_name(event),
        "scope": event.get("log_namespace") or "-",
        "message": event.get(_BRIEF_KEY) or _message(event),
    }
    access_fields = event.get(_FIELDS_KEY)
    if access_fields is not None:
        # The same keys, in the same order, as the loop below takes from the event, without
        # walking the event's own log_* keys.
        for key, value in access_fields.items():
            if key not in _CORE_KEYS:
                flat[key] = value if value.__class__ in _PLAIN_TYPES else _jsonable(value)
    else:
        legacy = event.get("log_namespace") == "log_legacy" or "isError" in event
        for key, value in event.items():
            if key.startswith("log_") or key in _CORE_KEYS or (legacy and key in _LEGACY_KEYS):
                continue
            flat[key] = _jsonable(value)
    failure = event.get("log_failure")
    if failure is not None:
        flat["error"] = failure.getTraceback()
    elif "error" in event:
        flat["error"] = _jsonable(event["error"])
    return flat


@implementer(ILogObserver)
@attrs.define(eq=False)
class _FileObserver:
    """Writes each event as ``render`` makes it (nothing for an empty text) to ``out_file``, flushed."""

    _out_file: IO[str]
    _render: Callable[[dict[str, Any]], str | None]

    def __call__(self, event: dict[str, Any]) -> None:
        text = self._render(event)
        if text:
            self._out_file.write(text)
            flush = getattr(self._out_file, "flush", None)
            if flush is not None:
                flush()


# json.dumps() with an option builds a new encoder per call.
_JSON = json.JSONEncoder(allow_nan=False)


def _json_line(event: dict[str, Any]) -> str:
    return _JSON.encode(event_as_flat_dict(event)) + "\n"


def json_observer(out_file: IO[str]) -> ILogObserver:
    """One flat JSON object per line: time, level, scope, message, fields, error."""
    return _FileObserver(out_file, _json_line)


# What makes a key=value value need quotes: whitespace (re's \s is exactly str.isspace), '"', '=' or a backslash.
_NEEDS_QUOTES = re.compile(r'[\s"=\\]')


def _quote(value: Any) -> str:
    text = str(value)
    if not text or _NEEDS_QUOTES.search(text):
        return json.dumps(text)
    return text


def text_observer(out_file: IO[str]) -> ILogObserver:
    """Twisted's classic text lines (access-log events carry their fields in their text)."""
    return _FileObserver(out_file, formatEventAsClassicLogText)


def observer_for(fmt: str, out_file: IO[str]) -> ILogObserver:
    """The observer for a ``--log-format`` value: "json" or "text"."""
    if fmt == "json":
        return json_observer(out_file)
    if fmt == "text":
        return text_observer(out_file)
    raise ValueError(f"unknown log format {fmt!r}: expected 'json' or 'text'")


@functools.cache  # a handful of names, one lookup for each field of each access-log line
def _field_name(name: str) -> str:
    """``src_addr`` -> ``src.addr``, so callers can pass plain keyword arguments."""
    for prefix in ("src_", "dst_"):
        if name.startswith(prefix):
            return prefix[:-1] + "." + name[len(prefix) :]
    return name


def format_duration(seconds: float) -> str:
    """ztunnel's duration rendering: whole milliseconds with an ``ms`` suffix."""
    return f"{int(seconds * 1000)}ms"


def access_log(log: Logger, **fields: Any) -> None:
    """Emit one "connection complete" access-log event through ``log``'s observer.

    Field names are ztunnel's; ``src_addr=`` is accepted for ``src.addr``.
    ``duration`` is seconds (a number) and is rendered like ztunnel ("12ms");
    a string is passed through. Fields that are None are left out. An
    ``error`` makes the event error-level.
    """
    event: dict[str, Any] = {_field_name(name): value for name, value in fields.items() if value is not None}
    duration = event.get("duration")
    if isinstance(duration, (int, float)):
        event["duration"] = format_duration(duration)
    if "direction" in event and event["direction"] not in ("inbound", "outbound"):
        raise ValueError(f"direction must be 'inbound' or 'outbound', not {event['direction']!r}")
    ordered = {key: event[key] for key in _in_access_order(tuple(event))}
    level = LogLevel.error if "error" in ordered else LogLevel.info
    # Field names hold dots, which a format string cannot name: the text is rendered by a
    # call, and only for an observer that formats it (the JSON observer writes the fields).
    access = log if log.namespace == ACCESS_NAMESPACE else _access_logger(log)
    # The event Logger.emit(level, _ACCESS_FORMAT, ...) would make, without its check that
    # ``level`` is a LogLevel (it is one of two here): that check sorts LogLevel's constants
    # through constantly's lookups, for every line.
    event = {
        _BRIEF_KEY: ACCESS_MESSAGE,
        _TEXT_KEY: functools.partial(_access_text, ordered),
        _FIELDS_KEY: ordered,
        **ordered,
        "log_logger": access,
        "log_level": level,
        "log_namespace": access.namespace,
        "log_source": access.source,
        "log_format": _ACCESS_FORMAT,
        "log_time": time.time(),
    }
    access.observer(event)


_ACCESS_FORMAT = "{" + _TEXT_KEY + "()}"


def _access_logger(log: Logger) -> Logger:
    """``log``'s source and observer, in the access-log namespace."""
    return Logger(namespace=ACCESS_NAMESPACE, source=log.source, observer=log.observer)


@functools.lru_cache(maxsize=64)  # a handful of key sets: a record's fields, with or without an error
def _in_access_order(keys: tuple[str, ...]) -> tuple[str, ...]:
    """``keys`` with ztunnel's fields first, in its order, then the others as given."""
    return tuple(key for key in ACCESS_FIELDS if key in keys) + tuple(key for key in keys if key not in ACCESS_FIELDS)


def _access_text(fields: dict[str, Any]) -> str:
    """An access-log event's text: the message, then ``key=value`` for each field."""
    return " ".join([ACCESS_MESSAGE, *(f"{key}={_quote(value)}" for key, value in fields.items())])
