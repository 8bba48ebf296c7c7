"""Finding drain strategies through Twisted's plugin system and composing them by name."""

from __future__ import annotations

import re

from twisted.logger import Logger
from twisted.plugin import getPlugins

from ztwisted.interfaces import IDrainStrategy

DEFAULT_STRATEGY = "immediate"
#: what --drain-strategy can name (commas and "+" compose)
VALID_NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")
log = Logger()


class UnknownStrategy(ValueError):
    pass


def installed_strategies() -> dict:
    """Every installed strategy by name (built-in ones and those of other packages)."""
    import twisted.plugins

    strategies = {}
    for strategy in getPlugins(IDrainStrategy, twisted.plugins):
        name = getattr(strategy, "name", "")
        if not VALID_NAME.fullmatch(name or ""):
            log.warn(
                "ignoring drain strategy {strategy!r}: its name {name!r} cannot be selected",
                strategy=strategy,
                name=name,
            )
        elif name in strategies:
            log.warn(
                "two drain strategies are named {name!r}: using {kept!r}, ignoring {ignored!r}",
                name=name,
                kept=strategies[name],
                ignored=strategy,
            )
        else:
            strategies[name] = strategy
    return dict(sorted(strategies.items()))


def select(spec: str, available: dict | None = None) -> list:
    """``"a,b"`` (or ``"a+b"``) -> the strategies, in order; unknown names raise UnknownStrategy."""
    available = installed_strategies() if available is None else available
    names = [name.strip() for name in spec.replace("+", ",").split(",") if name.strip()]
    if not names:
        raise UnknownStrategy("no drain strategy named; choose from: " + ", ".join(available))
    unknown = [name for name in names if name not in available]
    if unknown:
        raise UnknownStrategy(
            f"unknown drain strateg{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)}; "
            f"installed: {', '.join(available)}"
        )
    return [available[name] for name in dict.fromkeys(names)]


def describe(available: dict | None = None) -> str:
    available = installed_strategies() if available is None else available
    width = max((len(name) for name in available), default=0)
    return "\n".join(f"  {name.ljust(width)}  {strategy.description}" for name, strategy in available.items())
