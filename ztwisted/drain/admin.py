"""Admin endpoints that raise drain events: ``POST /drain``, ``POST /workloads/<uid>/terminating``,
``DELETE /workloads/<uid>``."""

from __future__ import annotations

from twisted.logger import Logger
from twisted.web.server import NOT_DONE_YET

from ztwisted.admin import TEXT, Endpoint
from ztwisted.interfaces import IDrainEvents, IDrainView

log = Logger()


class Drain(Endpoint):
    description = "POST: start the proxy-stopping drain (stop accepting, GOAWAY, wait); the process stays up"
    allowed_methods = (b"POST",)

    def __init__(self, events: IDrainEvents):
        super().__init__()
        self.events = events

    def render_POST(self, request) -> bytes:
        log.info("drain requested via POST /drain from {client}", client=request.getClientAddress())
        self.events.begin_proxy_drain()
        request.setHeader(b"Content-Type", TEXT)
        return b"draining\n"


class Workloads(Endpoint):
    """``DELETE /workloads/<uid>`` (pod removed) and ``POST /workloads/<uid>/terminating``.

    ``<uid>`` is a local workload's uid (percent-encode its slashes) or its
    ``name`` or ``namespace/name``. The answer comes when the event completes.
    """

    description = "DELETE <uid>: pod removed; POST <uid>/terminating: pod terminating (local-config mode)"
    allowed_methods = (b"POST", b"DELETE")

    def __init__(self, view: IDrainView, events: IDrainEvents):
        super().__init__()
        self.view = view
        self.events = events

    def render(self, request):
        segments = [segment.decode("utf-8", "replace") for segment in request.postpath if segment]
        if not segments:
            return self._answer(request, 404, "name a workload: /workloads/<uid>\n")
        if segments[-1] == "terminating" and len(segments) >= 2:
            method, event, who = b"POST", "terminating", "/".join(segments[:-1])
        else:
            method, event, who = b"DELETE", "removed", "/".join(segments)
        if request.method != method:
            request.setHeader(b"Allow", method)
            return self._answer(request, 405, f"use {method.decode()} for pod {event}\n")
        workload = self.view.local_workload(who)
        if workload is None:
            return self._answer(request, 404, f"no local workload {who!r}\n")
        log.info("pod {event} for {workload} requested via the admin API", event=event, workload=workload.name)
        done = self.events.pod_terminating(workload) if event == "terminating" else self.events.pod_removed(workload)

        def finish(_):
            if not request.finished and not request._disconnected:
                request.setHeader(b"Content-Type", TEXT)
                request.write(f"pod {event}: {workload.uid}\n".encode())
                request.finish()

        done.addBoth(finish)
        return NOT_DONE_YET

    @staticmethod
    def _answer(request, code: int, text: str) -> bytes:
        request.setResponseCode(code)
        request.setHeader(b"Content-Type", TEXT)
        return text.encode()


def drain_admin_routes(view: IDrainView, events: IDrainEvents) -> dict:
    return {"/drain": Drain(events), "/workloads": Workloads(view, events)}
