"""``twistd --reactor=ztwisted-epoll``: the reactor ``twistd ztunnel`` picks when none is named."""

from twisted.application.reactors import Reactor

ztwisted_epoll = Reactor(
    "ztwisted-epoll",
    "ztwisted.reactor",
    "epoll() without Twisted's per-event legacy log context (Linux; ztwisted's default)",
)
