"""Fixtures shared by unit tests."""

from __future__ import annotations

import pytest
from twisted.logger import globalLogPublisher


@pytest.fixture
def logged():
    """Every log event emitted during the test, in order."""
    events = []
    globalLogPublisher.addObserver(events.append)
    yield events
    globalLogPublisher.removeObserver(events.append)
