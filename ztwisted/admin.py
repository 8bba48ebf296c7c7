"""HTTP resources for the admin (15000), metrics (15020) and readiness (15021) ports.

Each ``*_resource`` function returns the root of one tree; serve each with
its own ``twisted.web.server.Site``. The admin tree acts through
:class:`AdminActions` (or any object with ``config_dump()``, ``quit()`` and
optionally ``admin_routes()``); readiness asks ``readiness()``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import attrs
from twisted.internet import defer
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.web.resource import IResource, Resource
from twisted.web.server import Request

log = Logger()

TEXT = b"text/plain; charset=utf-8"
JSON = b"application/json"


@attrs.frozen
class AdminActions:
    """What the admin endpoints act through."""

    #: the ``/config_dump`` document
    config_dump: Callable[[], dict]
    #: ``POST /quitquitquit``: stop the process the way SIGTERM does
    quit: Callable[[], object]
    #: extra routes, path -> resource, asked per request
    admin_routes: Callable[[], Mapping[str, IResource]] = dict


def _path(request: Request) -> str:
    path = getattr(request, "path", None) or b"/" + b"/".join(request.prepath + request.postpath)
    return path.decode("utf-8", "replace")


class TextPage(Resource):
    """A fixed plain-text response for any method (used for 404s and errors)."""

    isLeaf = True

    def __init__(self, code: int, text: str) -> None:
        super().__init__()
        self.code = code
        self.text = text

    def render(self, request: Request) -> bytes:
        request.setResponseCode(self.code)
        request.setHeader(b"Content-Type", TEXT)
        return self.text.encode("utf-8")


def _not_found(request: Request) -> TextPage:
    return TextPage(404, f"not found: {_path(request)}\n")


class Endpoint(Resource):
    """A leaf answering ``allowed_methods`` via ``render_<METHOD>``; others get 405.

    HEAD is answered like GET, without the body. Twisted's own dispatch
    answers unknown methods with 501, and counts HEAD as allowed everywhere.
    """

    isLeaf = True
    allowed_methods: tuple[bytes, ...] = (b"GET",)
    description = ""

    def render(self, request: Request) -> bytes:
        if any(request.postpath):
            return _not_found(request).render(request)
        method = request.method
        if method == b"HEAD" and b"GET" in self.allowed_methods:
            body = self.render_GET(request)
            request.setHeader(b"Content-Length", b"%d" % len(body))
            return b""
        if method not in self.allowed_methods:
            allowed = list(self.allowed_methods)
            if b"GET" in allowed:
                allowed.append(b"HEAD")
            request.setResponseCode(405)
            request.setHeader(b"Allow", b", ".join(allowed))
            request.setHeader(b"Content-Type", TEXT)
            return (
                f"method {method.decode('ascii', 'replace')} not allowed on "
                f"{_path(request)}; allowed: {b', '.join(allowed).decode()}\n"
            ).encode()
        return getattr(self, "render_" + method.decode("ascii"))(request)

    def render_GET(self, request: Request) -> bytes:  # pragma: no cover - overridden
        raise NotImplementedError


class _Tree(Resource):
    """An inner node whose unknown children are plain-text 404s."""

    def getChild(self, path: bytes, request: Request) -> IResource:
        return _not_found(request)


# -- admin -------------------------------------------------------------------


class ConfigDump(Endpoint):
    description = "GET: the node's configuration and state, as JSON"

    def __init__(self, node: Any) -> None:
        super().__init__()
        self.node = node

    def render_GET(self, request: Request) -> bytes:
        try:
            body = json.dumps(self.node.config_dump(), indent=2, default=str) + "\n"
        except Exception as e:  # noqa: BLE001 - logged, and answered with a clear 500
            log.failure("config_dump failed")
            request.setResponseCode(500)
            request.setHeader(b"Content-Type", TEXT)
            return f"config_dump failed: {type(e).__name__}: {e}\n".encode()
        request.setHeader(b"Content-Type", JSON)
        return body.encode("utf-8")


class QuitQuitQuit(Endpoint):
    description = "POST: shut the node down (drains first)"
    allowed_methods = (b"POST",)

    def __init__(self, node: Any, clock: IReactorTime) -> None:
        super().__init__()
        self.node = node
        self.clock = clock

    def render_POST(self, request: Request) -> bytes:
        log.info("shutdown requested via POST /quitquitquit from {client}", client=request.getClientAddress())
        # Next turn, so the response is written before shutdown starts.
        self.clock.callLater(0, self._quit)
        request.setHeader(b"Content-Type", TEXT)
        return b"OK\n"

    def _quit(self) -> None:
        defer.maybeDeferred(self.node.quit).addErrback(
            lambda failure: log.failure("quit after /quitquitquit failed", failure)
        )


class _AdminIndex(Endpoint):
    description = "GET: this list"

    def __init__(self, root: AdminRoot) -> None:
        super().__init__()
        self.root = root

    def render_GET(self, request: Request) -> bytes:
        lines = ["ztwisted admin endpoints:"]
        entries = {"/": self.description}
        for name, child in self.root.children.items():
            entries["/" + name.decode()] = getattr(child, "description", "")
        try:
            extra = self.root.extra_routes()
        except Exception:  # noqa: BLE001 - logged; the index still lists built-ins
            log.failure("node.admin_routes() failed")
            extra = {}
        for path, resource in extra.items():
            entries.setdefault(path, getattr(resource, "description", ""))
        for path in sorted(entries):
            lines.append(f"  {path}  {entries[path]}".rstrip())
        request.setHeader(b"Content-Type", TEXT)
        return ("\n".join(lines) + "\n").encode("utf-8")


def _split(path: str) -> tuple[bytes, ...]:
    return tuple(s.encode("utf-8") for s in path.strip("/").split("/") if s)


class AdminRoot(Resource):
    """Built-in endpoints, plus whatever ``node.admin_routes()`` returns right now.

    Routes are looked up per request so features may add them at any time.
    A route path may have several segments (``/workloads/terminating``); the
    longest match wins, and deeper segments are the mounted resource's to
    resolve. Built-in endpoints cannot be overridden.
    """

    def __init__(self, node: Any, clock: IReactorTime) -> None:
        super().__init__()
        self.node = node
        self.putChild(b"config_dump", ConfigDump(node))
        self.putChild(b"quitquitquit", QuitQuitQuit(node, clock))
        self._index = _AdminIndex(self)

    def extra_routes(self) -> dict[str, IResource]:
        routes_of: Callable[[], Mapping[str, IResource]] | None = getattr(self.node, "admin_routes", None)
        if routes_of is None:
            return {}
        return {
            "/" + "/".join(s.decode() for s in _split(path)): resource for path, resource in (routes_of() or {}).items()
        }

    def getChild(self, path: bytes, request: Request) -> IResource:
        if path == b"" and not any(request.postpath):
            return self._index
        try:
            routes = self.extra_routes()
        except Exception as e:  # noqa: BLE001 - logged, and answered with a clear 500
            log.failure("node.admin_routes() failed")
            return TextPage(500, f"admin routes unavailable: {type(e).__name__}: {e}\n")
        wanted = (path, *request.postpath)
        for route_path, resource in sorted(routes.items(), key=lambda kv: -len(_split(kv[0]))):
            segments = _split(route_path)
            if segments and wanted[: len(segments)] == segments:
                # Move the extra segments we matched from postpath to prepath.
                for _ in segments[1:]:
                    request.prepath.append(request.postpath.pop(0))
                return resource
        return _not_found(request)


def admin_resource(node: Any, clock: IReactorTime | None = None) -> AdminRoot:
    """The admin tree: ``/config_dump``, ``POST /quitquitquit``, ``/`` and extra routes."""
    if clock is None:
        from twisted.internet import reactor as clock  # type: ignore[assignment]
    return AdminRoot(node, clock)


# -- metrics -----------------------------------------------------------------


class MetricsPage(Endpoint):
    description = "GET: Prometheus metrics"

    def __init__(self, metrics: Any) -> None:
        super().__init__()
        self.metrics = metrics

    def render_GET(self, request: Request) -> bytes:
        request.setHeader(b"Content-Type", self.metrics.content_type.encode("ascii"))
        return self.metrics.render()


def metrics_resource(metrics: Any) -> Resource:
    """The metrics tree: ``/metrics`` and ``/stats/prometheus``."""
    page = MetricsPage(metrics)
    root = _Tree()
    root.putChild(b"metrics", page)
    stats = _Tree()
    stats.putChild(b"prometheus", page)
    root.putChild(b"stats", stats)
    return root


# -- readiness ---------------------------------------------------------------


class ReadyPage(Endpoint):
    description = "GET: 200 when ready, else 500 naming what is pending"

    def __init__(self, node: Any) -> None:
        super().__init__()
        self.node = node

    def render_GET(self, request: Request) -> bytes:
        request.setHeader(b"Content-Type", TEXT)
        try:
            pending = list(self.node.readiness())
        except Exception as e:  # noqa: BLE001 - logged; a failing check means not ready
            log.failure("node.readiness() failed")
            request.setResponseCode(500)
            return f"not ready, readiness check failed: {type(e).__name__}: {e}\n".encode()
        if not pending:
            return b"ready\n"
        request.setResponseCode(500)
        return f"not ready, pending: {', '.join(map(str, pending))}\n".encode()


def readiness_resource(node: Any) -> Resource:
    """The readiness tree: ``GET /healthz/ready``."""
    root = _Tree()
    healthz = _Tree()
    healthz.putChild(b"ready", ReadyPage(node))
    root.putChild(b"healthz", healthz)
    return root
