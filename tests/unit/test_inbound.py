"""The parts of an inbound HBONE tunnel request that are read from the peer's headers."""

from __future__ import annotations

import pytest

from ztwisted.hbone.inbound import forwarded_for, parse_authority


@pytest.mark.parametrize(
    "authority, expected",
    [
        ("10.0.0.5:8080", ("10.0.0.5", 8080)),
        ("[fd00::0:5]:443", ("fd00::5", 443)),
        ("[FD00::5]:443", ("fd00::5", 443)),
        ("10.0.0.5:65535", ("10.0.0.5", 65535)),
        ("10.0.0.5:0", None),
        ("10.0.0.5:65536", None),
        ("10.0.0.5", None),
        ("10.0.0.5:", None),
        ("10.0.0.5:+80", None),
        ("example.com:80", None),
        ("", None),
        ("10.0.0.5:\u00b2", None),
        ("10.0.0.5:\u0668\u0660", None),
        ("[fe80::1%eth0]:80", None),
        ("[fe80::1]:80", ("fe80::1", 80)),
    ],
)
def test_parse_authority(authority, expected):
    # Twice: the second answer is the remembered one.
    assert parse_authority(authority) == expected
    assert parse_authority(authority) == expected


def test_what_cannot_be_an_address_is_not_remembered():
    from ztwisted.hbone.inbound import _parse_authority

    before = _parse_authority.cache_info().currsize
    for n in range(50):
        assert parse_authority(f"[fe80::1%{'x' * 60_000}{n}]:80") is None
        assert parse_authority(f"{'1' * 60_000}{n}:80") is None
    assert _parse_authority.cache_info().currsize == before


@pytest.mark.parametrize(
    "header, expected",
    [
        ('for="10.0.0.1:40000"', "10.0.0.1:40000"),
        ('for="[fd00::1]:40000"', "[fd00::1]:40000"),
        ("for=10.0.0.1", "10.0.0.1"),
        ('proto=https;For="10.0.0.1:1", for=10.0.0.2', "10.0.0.1:1"),
        ("by=10.0.0.9", None),
        ("for=", None),
        ("", None),
        (None, None),
    ],
)
def test_forwarded_for(header, expected):
    assert forwarded_for(header) == expected
