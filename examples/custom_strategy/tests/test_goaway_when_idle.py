"""Tests of the goaway-when-idle strategy, on fakes of the node facade and its connections."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from goaway_when_idle import GoawayWhenIdle
from twisted.internet import defer, task
from twisted.plugin import IPlugin
from zope.interface.verify import verifyObject

from ztwisted.interfaces import IDrainStrategy
from ztwisted.model import Workload

PLUGIN_FILE = Path(__file__).parents[1] / "twisted" / "plugins" / "goaway_when_idle_plugin.py"
POD = Workload(uid="cluster1//v1/Pod/default/echo", name="echo", namespace="default", workload_ips=["10.0.0.7"])


class FakeStream:
    def __init__(self):
        self.finished = defer.Deferred()


class FakeConnection:
    """The parts of an HBONEConnection the strategy uses: streams, usable, drain()."""

    def __init__(self, streams: int = 0):
        self.streams = {2 * i + 1: FakeStream() for i in range(streams)}
        self.drains: list[tuple[bool, float | None]] = []

    @property
    def usable(self) -> bool:
        return not self.drains

    def drain(self, graceful=True, deadline=None):
        self.drains.append((graceful, deadline))
        return defer.Deferred()

    def open_stream(self) -> FakeStream:
        stream_id = max(self.streams, default=-1) + 2
        self.streams[stream_id] = FakeStream()
        return self.streams[stream_id]

    def end_stream(self, stream_id: int) -> None:
        # As the real connection does: forget the stream, then fire its Deferred.
        self.streams.pop(stream_id).finished.callback("closed")


class FakeNode:
    """The drain facade, as far as this strategy uses it."""

    def __init__(self, connections):
        self.clock = task.Clock()
        self.connections = connections

    def inbound_connections(self, workload=None):
        return list(self.connections)


def test_the_plugin_object_provides_both_interfaces():
    spec = importlib.util.spec_from_file_location("goaway_when_idle_plugin", PLUGIN_FILE)
    plugin_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plugin_module)
    strategy = plugin_module.goaway_when_idle
    assert verifyObject(IPlugin, strategy)
    assert verifyObject(IDrainStrategy, strategy)
    assert strategy.name == "goaway-when-idle"


def test_idle_connections_get_goaway_at_once_and_the_event_completes():
    idle, busy = FakeConnection(), FakeConnection(streams=1)
    node = FakeNode([idle, busy])
    done = defer.maybeDeferred(GoawayWhenIdle().pod_terminating, node, POD)
    assert done.called
    assert idle.drains == [(True, None)]
    assert busy.drains == []


def test_a_busy_connection_gets_goaway_after_its_last_tunnel_even_one_opened_later():
    busy = FakeConnection(streams=2)
    node = FakeNode([busy])
    GoawayWhenIdle().pod_terminating(node, POD)
    busy.end_stream(1)
    node.clock.advance(0)
    later = busy.open_stream()  # clients keep using the connection meanwhile
    busy.end_stream(3)
    node.clock.advance(0)
    assert busy.drains == []
    busy.end_stream(max(busy.streams))
    node.clock.advance(0)
    assert later.finished.called
    assert busy.drains == [(True, None)]


def test_the_stream_outcome_is_passed_on_to_other_callbacks():
    busy = FakeConnection(streams=1)
    GoawayWhenIdle().pod_terminating(FakeNode([busy]), POD)
    seen = []
    busy.streams[1].finished.addCallback(seen.append)
    busy.end_stream(1)
    assert seen == ["closed"]


def test_after_pod_removed_nothing_more_is_sent():
    busy = FakeConnection(streams=1)
    node = FakeNode([busy])
    strategy = GoawayWhenIdle()
    strategy.pod_terminating(node, POD)
    strategy.pod_removed(node, POD)
    busy.end_stream(1)
    node.clock.advance(0)
    assert busy.drains == []
