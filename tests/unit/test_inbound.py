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
    ],
)
def test_parse_authority(authority, expected):
    # Twice: the second answer is the remembered one.
    assert parse_authority(authority) == expected
    assert parse_authority(authority) == expected


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
