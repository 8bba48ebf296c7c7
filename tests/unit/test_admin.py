"""Tests for the admin, metrics and readiness HTTP resources, over real HTTP."""

from __future__ import annotations

import json

import pytest_twisted
from twisted.internet import defer, reactor, task
from twisted.internet.protocol import Protocol
from twisted.web.client import Agent, ResponseDone
from twisted.web.http_headers import Headers
from twisted.web.resource import Resource, getChildForRequest
from twisted.web.server import Site
from twisted.web.test.requesthelper import DummyRequest

from ztwisted.admin import admin_resource, metrics_resource, readiness_resource
from ztwisted.metrics import Metrics


class FakeNode:
    def __init__(self) -> None:
        self.dump: object = {"workloads": [{"uid": "w1", "ips": ["10.0.0.1"]}], "draining": False}
        self.quits = 0
        self.quit_called: defer.Deferred = defer.Deferred()
        self.pending: list[str] = []
        self.routes: dict[str, Resource] = {}

    def config_dump(self):
        if isinstance(self.dump, Exception):
            raise self.dump
        return self.dump

    def quit(self):
        self.quits += 1
        if not self.quit_called.called:
            self.quit_called.callback(None)

    def readiness(self):
        if isinstance(self.pending, Exception):
            raise self.pending
        return self.pending

    def admin_routes(self):
        return self.routes


class Echo(Resource):
    """Reports where it was mounted and what path is left."""

    isLeaf = True
    description = "GET: echo"

    def render_GET(self, request):
        return b"prepath=%s postpath=%s" % (b"/".join(request.prepath), b"/".join(request.postpath))

    render_POST = render_GET


class BodyCollector(Protocol):
    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.done: defer.Deferred = defer.Deferred()

    def dataReceived(self, data: bytes) -> None:
        self.chunks.append(data)

    def connectionLost(self, reason) -> None:
        if reason.check(ResponseDone):
            self.done.callback(b"".join(self.chunks))
        else:
            self.done.errback(reason)


def read_body(response) -> defer.Deferred:
    collector = BodyCollector()
    response.deliverBody(collector)
    return collector.done


class Served:
    def __init__(self, resource) -> None:
        self.port = reactor.listenTCP(0, Site(resource), interface="127.0.0.1")
        self.base = b"http://127.0.0.1:%d" % self.port.getHost().port
        self.agent = Agent(reactor)

    @defer.inlineCallbacks
    def fetch(self, method: bytes, path: bytes):
        response = yield self.agent.request(method, self.base + path, Headers())
        body = yield read_body(response)
        return response.code, response.headers, body

    def close(self):
        return self.port.stopListening()


def header(headers: Headers, name: bytes) -> bytes | None:
    values = headers.getRawHeaders(name)
    return values[0] if values else None


@pytest_twisted.inlineCallbacks
def test_config_dump_is_pretty_json():
    node = FakeNode()
    served = Served(admin_resource(node))
    try:
        code, headers, body = yield served.fetch(b"GET", b"/config_dump")
    finally:
        yield served.close()
    assert code == 200
    assert header(headers, b"content-type") == b"application/json"
    assert json.loads(body) == node.dump
    assert b'\n  "workloads": [' in body


@pytest_twisted.inlineCallbacks
def test_config_dump_failure_is_a_clear_500():
    node = FakeNode()
    node.dump = RuntimeError("store not loaded")
    served = Served(admin_resource(node))
    try:
        code, _, body = yield served.fetch(b"GET", b"/config_dump")
    finally:
        yield served.close()
    assert code == 500
    assert body == b"config_dump failed: RuntimeError: store not loaded\n"


@pytest_twisted.inlineCallbacks
def test_quitquitquit_answers_then_quits():
    node = FakeNode()
    served = Served(admin_resource(node))
    try:
        code, _, body = yield served.fetch(b"POST", b"/quitquitquit")
        yield node.quit_called
    finally:
        yield served.close()
    assert (code, body) == (200, b"OK\n")
    assert node.quits == 1


def test_quit_happens_on_the_next_turn():
    node = FakeNode()
    clock = task.Clock()
    root = admin_resource(node, clock=clock)
    request = DummyRequest([b"quitquitquit"])
    request.method = b"POST"
    resource = getChildForRequest(root, request)
    assert resource.render(request) == b"OK\n"
    assert node.quits == 0
    clock.advance(0)
    assert node.quits == 1


@pytest_twisted.inlineCallbacks
def test_wrong_methods_get_405_with_allow():
    served = Served(admin_resource(FakeNode()))
    try:
        get_quit = yield served.fetch(b"GET", b"/quitquitquit")
        delete_dump = yield served.fetch(b"DELETE", b"/config_dump")
        head_dump = yield served.fetch(b"HEAD", b"/config_dump")
    finally:
        yield served.close()
    assert get_quit[0] == 405
    assert header(get_quit[1], b"allow") == b"POST"
    assert b"method GET not allowed on /quitquitquit" in get_quit[2]
    assert delete_dump[0] == 405
    assert header(delete_dump[1], b"allow") == b"GET, HEAD"
    assert head_dump[0] == 200 and head_dump[2] == b""


@pytest_twisted.inlineCallbacks
def test_index_lists_builtin_and_extra_endpoints():
    node = FakeNode()
    node.routes = {"/drain": Echo()}
    served = Served(admin_resource(node))
    try:
        code, headers, body = yield served.fetch(b"GET", b"/")
    finally:
        yield served.close()
    assert code == 200
    assert header(headers, b"content-type").startswith(b"text/plain")
    text = body.decode()
    for path in ("/config_dump", "/quitquitquit", "/drain"):
        assert f"  {path}  " in text


@pytest_twisted.inlineCallbacks
def test_extra_routes_are_mounted_and_resolved_per_request():
    node = FakeNode()
    served = Served(admin_resource(node))
    try:
        before = yield served.fetch(b"POST", b"/drain")
        node.routes = {"/drain": Echo(), "workloads/terminating/": Echo(), "/workloads": Echo()}
        drain = yield served.fetch(b"POST", b"/drain")
        deep = yield served.fetch(b"GET", b"/workloads/terminating/pod-1")
        shallow = yield served.fetch(b"GET", b"/workloads/pod-2/terminating")
        node.routes = {"/config_dump": Echo()}
        builtin = yield served.fetch(b"GET", b"/config_dump")
    finally:
        yield served.close()
    assert before[0] == 404 and before[2] == b"not found: /drain\n"
    assert drain[2] == b"prepath=drain postpath="
    assert deep[2] == b"prepath=workloads/terminating postpath=pod-1"
    assert shallow[2] == b"prepath=workloads postpath=pod-2/terminating"
    assert json.loads(builtin[2]) == node.dump


def test_node_without_admin_routes_hook():
    class MinimalNode:
        def config_dump(self):
            return {}

        def quit(self):
            pass

    root = admin_resource(MinimalNode(), clock=task.Clock())
    request = DummyRequest([b"anything"])
    resource = getChildForRequest(root, request)
    assert resource.render(request) == b"not found: /anything\n"
    assert request.responseCode == 404


@pytest_twisted.inlineCallbacks
def test_metrics_on_both_paths():
    metrics = Metrics()
    metrics.config_reloads.inc()
    served = Served(metrics_resource(metrics))
    try:
        first = yield served.fetch(b"GET", b"/metrics")
        second = yield served.fetch(b"GET", b"/stats/prometheus")
        root = yield served.fetch(b"GET", b"/")
        post = yield served.fetch(b"POST", b"/metrics")
    finally:
        yield served.close()
    for code, headers, body in (first, second):
        assert code == 200
        assert header(headers, b"content-type") == metrics.content_type.encode()
        assert b"ztwisted_config_reloads_total 1.0" in body
    assert root[0] == 404
    assert post[0] == 405


@pytest_twisted.inlineCallbacks
def test_readiness():
    node = FakeNode()
    served = Served(readiness_resource(node))
    try:
        node.pending = ["workloads", "certificates"]
        not_ready = yield served.fetch(b"GET", b"/healthz/ready")
        node.pending = []
        ready = yield served.fetch(b"GET", b"/healthz/ready")
        node.pending = RuntimeError("boom")
        broken = yield served.fetch(b"GET", b"/healthz/ready")
        other = yield served.fetch(b"GET", b"/healthz/live")
    finally:
        yield served.close()
    assert not_ready[:1] + not_ready[2:] == (500, b"not ready, pending: workloads, certificates\n")
    assert ready[0] == 200 and ready[2] == b"ready\n"
    assert broken[0] == 500 and broken[2].startswith(b"not ready, readiness check failed: ")
    assert other[0] == 404
