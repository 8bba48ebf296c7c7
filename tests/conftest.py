"""Before any test: the suite's loopback range must be free (see tests/support.py, TEST_NET)."""

from __future__ import annotations

import pytest

from tests.support import TEST_NET, listeners_in


def pytest_sessionstart(session):
    taken = listeners_in(TEST_NET)
    if taken:
        # pytest shows the reason twice (its own line and the summary): the list once, here.
        session.config.get_terminal_writer().line(
            f"The tests use 127.{TEST_NET}.0.0/16, where these listen already:\n  " + "\n  ".join(taken)
        )
        pytest.exit(
            f"127.{TEST_NET}.0.0/16 is in use (see above): stop what listens there (a proxy or a test run "
            "left running?), or pick another range: ZTWISTED_TEST_NET=N tox",
            returncode=3,
        )
