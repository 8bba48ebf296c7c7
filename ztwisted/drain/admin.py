"""Admin endpoints that raise drain events: ``POST /drain``, ``POST /workloads/<uid>/terminating``,
``DELETE /workloads/<uid>``."""

from __future__ import annotations

from twisted.logger import Logger
from twisted.web.server import NOT_DONE_YET

from ztwisted.admin import TEXT, Endpoint

log = Logger()


class Drain(Endpoint):
    description = "POST: start the proxy-stopping drain (stop accepting, GOAWAY, wait); the process stays up"
    allowed_methods = (b"POST",)

    def __init__(self, node):
        super().__init__()
        self.node = node

    def render_POST(self, request) -> bytes:
        log.info("drain requested via POST /drain from {client}", client=request.getClientAddress())
        self.node.begin_proxy_drain()
        request.setHeader(b"Content-Type", TEXT)
        return b"draining\n"


class Workloads(Endpoint):
    """``DELETE /workloads/<uid>`` (pod removed) and ``POST /workloads/<uid>/terminating``.

    ``<uid>`` is a local workload's uid (percent-encode its slashes) or its
    ``name`` or ``namespace/name``. The answer comes when the event completes.
    """

    description = "DELETE <uid>: pod removed; POST <uid>/terminating: pod terminating (local-config mode)"
    allowed_methods = (b"POST", b"DELETE")

    def __init__(self, node):
        super().__init__()
        self.node = node

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
        workload = self.node.local_workload(who)
        if workload is None:
            return self._answer(request, 404, f"no local workload {who!r}\n")
        log.info("pod {event} for {workload} requested via the admin API", event=event, workload=workload.name)
        done = self.node.pod_terminating(workload) if event == "terminating" else self.node.remove_pod(workload)

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


def drain_admin_routes(node) -> dict:
    return {"/drain": Drain(node), "/workloads": Workloads(node)}
