"""The ``reuseport:`` and ``reuseport6:`` server endpoint strings (SO_REUSEPORT, SO_MARK, netns)."""

from ztwisted.endpoints import ReusePortParser

reuseport = ReusePortParser("reuseport")
reuseport6 = ReusePortParser("reuseport6", "::")
