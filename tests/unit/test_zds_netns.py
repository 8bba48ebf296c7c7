"""Netns: recognising network-namespace fds (no privileges needed)."""

from __future__ import annotations

import errno
import os

import pytest

from ztwisted import netns as netns_module
from ztwisted.netns import Netns, NotANetworkNamespace


def _open(path):
    return Netns(os.open(path, os.O_RDONLY | os.O_CLOEXEC), name=path)


def test_own_network_namespace_passes_the_check():
    with Netns.current() as ns:
        ns.check()
        assert ns.inode == os.stat("/proc/self/ns/net").st_ino


def test_another_namespace_type_is_named_in_the_error():
    with _open("/proc/self/ns/mnt") as ns, pytest.raises(NotANetworkNamespace, match="is a mount namespace"):
        ns.check()


@pytest.mark.parametrize("path", ["/dev/null", "/proc/self/status", __file__])
def test_other_files_are_refused(path):
    with _open(path) as ns, pytest.raises(NotANetworkNamespace, match="not a network namespace"):
        ns.check()


def test_a_pipe_is_refused():
    r, w = os.pipe()
    os.close(w)
    with Netns(r, name="pipe") as ns, pytest.raises(NotANetworkNamespace, match="pipe is not a network namespace"):
        ns.check()


def _ioctl_unknown(*args):
    raise OSError(errno.ENOTTY, "Inappropriate ioctl for device")


def test_without_ns_get_nstype_any_nsfs_file_is_accepted(monkeypatch):
    # Kernels before 4.11 lack NS_GET_NSTYPE: fall back to the nsfs filesystem magic.
    monkeypatch.setattr(netns_module.fcntl, "ioctl", _ioctl_unknown)
    with Netns.current() as ns:
        ns.check()
    with _open("/dev/null") as ns, pytest.raises(NotANetworkNamespace, match="filesystem magic"):
        ns.check()


def test_open_checks_and_names_the_path(tmp_path):
    plain = tmp_path / "plain"
    plain.write_text("")
    with pytest.raises(NotANetworkNamespace, match=str(plain)):
        Netns.open(str(plain))
    with pytest.raises(FileNotFoundError, match="cannot open network namespace .*missing"):
        Netns.open(str(tmp_path / "missing"))


def test_close_is_idempotent_and_a_closed_netns_says_so():
    ns = Netns.current()
    fd = ns.fileno()
    ns.close()
    ns.close()
    assert ns.closed
    with pytest.raises(OSError):
        os.fstat(fd)
    with pytest.raises(ValueError, match="is closed"):
        ns.fileno()


def test_same_as_compares_the_namespace_not_the_fd():
    with Netns.current() as a, Netns.current() as b, _open("/proc/self/ns/mnt") as c:
        assert a.fileno() != b.fileno()
        assert a.same_as(b)
        assert not a.same_as(c)
