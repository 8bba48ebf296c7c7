"""The ``twistd ztunnel`` service maker (loaded lazily: importing it is cheap)."""

from twisted.application.service import ServiceMaker

ztunnel = ServiceMaker(
    "ztwisted HBONE node proxy",
    "ztwisted.tap",
    "An Istio ztunnel compatible HBONE node proxy with pluggable drain strategies.",
    "ztunnel",
)
