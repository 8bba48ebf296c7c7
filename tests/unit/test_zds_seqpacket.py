"""SeqpacketConnection / SeqpacketListener over real SOCK_SEQPACKET sockets on the real reactor."""

from __future__ import annotations

import array
import os
import socket

import pytest
import pytest_twisted
from twisted.internet import defer, error, reactor

from ztwisted.inpod.seqpacket import SeqpacketConnection, SeqpacketListener, connect_seqpacket
from ztwisted.tools.zds_testing import DatagramPeer, open_fd_count


class Recorder:
    def __init__(self):
        self.datagrams = defer.DeferredQueue()
        self.lost = defer.Deferred()
        self.lost_calls = 0

    def datagram_received(self, payload, fds, flags):
        self.datagrams.put((payload, fds, flags))

    def connection_lost(self, reason):
        self.lost_calls += 1
        self.lost.callback(reason.value)

    def next(self, timeout=5.0):
        return self.datagrams.get().addTimeout(timeout, reactor)


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    recorder = Recorder()
    conn = SeqpacketConnection(reactor, a, recorder, name="under-test")
    conn.start()
    yield conn, recorder, b
    conn.abort()
    b.close()


def _send_fds(sock, payload, fds):
    sock.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())])


def _close_all(fds):
    for fd in fds:
        os.close(fd)


@pytest_twisted.inlineCallbacks
def test_datagram_boundaries_are_kept(pair):
    _, recorder, peer = pair
    peer.send(b"one")
    peer.send(b"two-two")
    assert (yield recorder.next()) == (b"one", [], 0)
    assert (yield recorder.next()) == (b"two-two", [], 0)


@pytest_twisted.inlineCallbacks
def test_fds_arrive_as_scm_rights_and_are_close_on_exec(pair):
    _, recorder, peer = pair
    r, w = os.pipe()
    try:
        _send_fds(peer, b"with-fd", [r])
        payload, fds, flags = yield recorder.next()
        assert (payload, len(fds), flags) == (b"with-fd", 1, 0)
        assert os.fstat(fds[0]).st_ino == os.fstat(r).st_ino
        assert not os.get_inheritable(fds[0])  # MSG_CMSG_CLOEXEC
        _close_all(fds)
    finally:
        os.close(r)
        os.close(w)


@pytest_twisted.inlineCallbacks
def test_oversized_datagram_is_flagged_truncated(pair):
    _, recorder, peer = pair
    peer.send(b"x" * 5000)
    payload, fds, flags = yield recorder.next()
    assert len(payload) == 1024
    assert flags & socket.MSG_TRUNC
    assert fds == []


@pytest_twisted.inlineCallbacks
def test_too_many_fds_are_flagged_ctrunc_and_none_leak(pair):
    _, recorder, peer = pair
    before = open_fd_count()
    r, w = os.pipe()
    try:
        _send_fds(peer, b"many", [r] * 40)
        payload, fds, flags = yield recorder.next()
        assert payload == b"many"
        assert flags & socket.MSG_CTRUNC
        assert 0 < len(fds) < 40  # what fitted; the kernel closed the rest
        _close_all(fds)
    finally:
        os.close(r)
        os.close(w)
    assert open_fd_count() == before


@pytest_twisted.inlineCallbacks
def test_empty_datagram_is_not_mistaken_for_eof(pair):
    conn, recorder, peer = pair
    peer.send(b"")
    peer.send(b"after")
    assert (yield recorder.next()) == (b"", [], 0)
    assert (yield recorder.next()) == (b"after", [], 0)
    assert not conn.disconnected


@pytest_twisted.inlineCallbacks
def test_peer_close_reports_connection_lost_once(pair):
    conn, recorder, peer = pair
    peer.close()
    reason = yield recorder.lost.addTimeout(5, reactor)
    assert isinstance(reason, error.ConnectionDone)
    assert conn.disconnected
    conn.abort()
    assert recorder.lost_calls == 1


@pytest_twisted.inlineCallbacks
def test_send_passes_fds_and_the_caller_keeps_its_own(pair):
    conn, _, peer = pair
    r, w = os.pipe()
    try:
        conn.send(b"to-peer", [r])
        os.fstat(r)  # still ours
        peer.setblocking(True)
        peer.settimeout(5)
        payload, ancdata, flags, _ = yield defer.succeed(peer.recvmsg(100, socket.CMSG_SPACE(16)))
        assert payload == b"to-peer"
        ((level, kind, data),) = ancdata
        (fd,) = array.array("i", data)
        assert os.fstat(fd).st_ino == os.fstat(r).st_ino
        os.close(fd)
    finally:
        os.close(r)
        os.close(w)


@pytest_twisted.inlineCallbacks
def test_full_socket_queues_and_flushes_in_order():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    sender = SeqpacketConnection(reactor, a, Recorder(), name="sender")
    sender.start()
    count = 2000
    for i in range(count):
        sender.send(b"%06d" % i + b"." * 500)
    assert sender.queued > 0  # the kernel buffer filled up
    receiver = DatagramPeer(reactor, b)
    try:
        for i in range(count):
            payload, _, _ = yield receiver.next()
            assert payload.startswith(b"%06d" % i)
        assert sender.queued == 0
    finally:
        sender.abort()
        receiver.close()


@pytest_twisted.inlineCallbacks
def test_close_after_flush_sends_everything_first():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    recorder = Recorder()
    sender = SeqpacketConnection(reactor, a, recorder, name="sender")
    sender.start()
    for i in range(300):
        sender.send(b"%04d" % i + b"." * 500)
    sender.close_after_flush()
    assert not sender.disconnected
    with pytest.raises(error.ConnectionDone):
        sender.send(b"too late")
    receiver = DatagramPeer(reactor, b)
    for i in range(300):
        payload, _, _ = yield receiver.next()
        assert payload.startswith(b"%04d" % i)
    yield recorder.lost.addTimeout(5, reactor)
    yield receiver.lost.addTimeout(5, reactor)


def test_refuses_a_stream_socket():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b, pytest.raises(ValueError, match="SOCK_SEQPACKET"):
        SeqpacketConnection(reactor, a, Recorder())


@pytest_twisted.inlineCallbacks
def test_listener_accepts_and_removes_its_path(tmp_path):
    path = str(tmp_path / "agent.sock")
    (tmp_path / "agent.sock").write_text("stale")  # replaced, as the real agent does
    accepted = defer.DeferredQueue()
    listener = SeqpacketListener(reactor, path, accepted.put)
    try:
        client = connect_seqpacket(path)
        server_sock = yield accepted.get().addTimeout(5, reactor)
        server = DatagramPeer(reactor, server_sock, name="server")
        client_peer = DatagramPeer(reactor, client, name="client")
        client_peer.send(b"hello")
        assert (yield server.next())[0] == b"hello"
        server.send(b"back")
        assert (yield client_peer.next())[0] == b"back"
        server.close()
        client_peer.close()
    finally:
        listener.close()
    assert not os.path.exists(path)


def test_connect_to_a_missing_path_names_it(tmp_path):
    path = str(tmp_path / "nobody.sock")
    with pytest.raises(FileNotFoundError, match="nobody.sock"):
        connect_seqpacket(path)


@pytest_twisted.inlineCallbacks
def test_last_words_of_a_peer_that_left_our_datagrams_unread_still_arrive(pair):
    # A raw peer closing with unread data makes the kernel report ECONNRESET first.
    conn, recorder, peer = pair
    conn.send(b"request the peer never reads")
    peer.send(b"error ack")
    peer.close()
    assert (yield recorder.next()) == (b"error ack", [], 0)
    reason = yield recorder.lost.addTimeout(5, reactor)
    assert isinstance(reason, error.ConnectionLost)


def test_closing_discards_unread_datagrams_so_the_peer_gets_our_last_one():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours = SeqpacketConnection(reactor, a, Recorder(), name="closing")  # never started: nothing read
    before = open_fd_count()
    r, w = os.pipe()
    _send_fds(b, b"unread", [r])
    os.close(r)
    os.close(w)
    ours.send(b"last words")
    ours.close_after_flush()
    assert open_fd_count() == before - 1  # our socket is closed, and the unread datagram's fd too
    b.settimeout(5)
    assert b.recv(100) == b"last words"  # no ECONNRESET
    assert b.recv(100) == b""
    b.close()
