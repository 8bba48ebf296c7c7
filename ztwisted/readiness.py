"""What ``/healthz/ready`` waits for."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import attrs


@attrs.define
class Readiness:
    """Ready once nothing is pending: the node's own conditions, plus those of other parts."""

    #: conditions set and cleared by their owners (the drain controller's "draining")
    pending: set[str] = attrs.field(factory=set)
    #: callables returning what else readiness waits for (e.g. the node agent's snapshot)
    checks: list[Callable[[], Iterable[str]]] = attrs.field(factory=list)

    def readiness(self) -> list[str]:
        """Everything still pending, sorted; empty when ready."""
        pending = set(self.pending)
        for check in self.checks:
            pending.update(check())
        return sorted(pending)
