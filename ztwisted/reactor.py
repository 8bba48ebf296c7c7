"""The reactor ``twistd ztunnel`` runs on: Twisted's epoll reactor without a log context per event.

Twisted's epoll reactor wraps every ready file descriptor's ``doRead`` or
``doWrite`` in ``log.callWithLogger``, which copies the legacy logging
context (a dict) to put the protocol's ``logPrefix()`` in it, so that a
``twisted.python.log.msg`` call made inside shows that prefix as its
``system``. A proxy forwarding small messages handles one or two such events
per message and node, and this wrapping is ~10 % of the node's Python time
in a ping-pong (see ``benchmarks/README.md``). ztwisted logs through
``twisted.logger``, whose events carry their own namespace and never read
that context, so the wrapping buys ztwisted nothing.

What changes for anyone else's code: a legacy ``log.msg``/``log.err`` made
while a descriptor is handled (including Twisted's own report of an
exception raised by ``doRead``) has ``system`` ``"-"`` instead of the
protocol's prefix. Everything else, error handling included, is Twisted's
``EPollReactor``.

It is installed by ``twistd ztunnel`` when no reactor was chosen (see
:func:`install_unless_chosen`); ``twistd --reactor=NAME ztunnel`` still
picks any other, and ``twistd --reactor=ztwisted-epoll`` names this one.
"""

from __future__ import annotations

import sys

from twisted.internet.epollreactor import EPollReactor


class LeanEPollReactor(EPollReactor):
    """``EPollReactor`` that dispatches ready descriptors without ``log.callWithLogger``.

    The reactor's loop calls ``doIteration`` (``EPollReactor.doPoll`` under another name).
    """

    def doIteration(self, timeout: float | None) -> None:
        try:
            ready = self._poller.poll(-1 if timeout is None else timeout, len(self._selectables))
        except InterruptedError:
            return
        selectables = self._selectables
        handle = self._doReadOrWrite
        for fd, event in ready:
            selectable = selectables.get(fd)
            # Gone already: an earlier descriptor's handler in this batch removed it.
            if selectable is not None:
                handle(selectable, fd, event)


def install() -> None:
    """Install :class:`LeanEPollReactor` as the global reactor (the ``ztwisted-epoll`` plugin)."""
    from twisted.internet.main import installReactor

    installReactor(LeanEPollReactor())


def install_unless_chosen() -> None:
    """Install :class:`LeanEPollReactor` if no reactor is installed yet, on Linux.

    ``twistd`` installs a reactor named with ``--reactor`` while it parses its
    own options, before it loads the ``ztunnel`` subcommand; only when none
    was named is the reactor still free to choose here.
    """
    if "twisted.internet.reactor" not in sys.modules and sys.platform.startswith("linux"):
        install()
