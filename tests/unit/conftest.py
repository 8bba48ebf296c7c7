"""Fixtures shared by unit tests."""

from __future__ import annotations

import gc

import pytest
from twisted.logger import globalLogPublisher


@pytest.fixture
def logged():
    """Every log event emitted during the test, in order."""
    events = []
    globalLogPublisher.addObserver(events.append)
    yield events
    globalLogPublisher.removeObserver(events.append)


@pytest.fixture
def access_events():
    """The access-log events emitted during the test."""
    events = []

    def observe(event):
        if event.get("log_namespace") == "access":
            events.append(event)

    globalLogPublisher.addObserver(observe)
    yield events
    globalLogPublisher.removeObserver(observe)


@pytest.fixture
def no_cyclic_gc():
    """The cyclic garbage collector off: what is still alive after its last reference went is in a cycle."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


@pytest.fixture
def lean_reactor():
    """A :class:`ztwisted.reactor.LeanEPollReactor` of the test's own (not installed)."""
    from ztwisted.reactor import LeanEPollReactor

    reactor = LeanEPollReactor()
    yield reactor
    # Not removeAll(): the test's sockets may be closed already, and closing epoll forgets them.
    reactor.waker.connectionLost(None)
    reactor._poller.close()
