"""ztwisted: an HBONE node proxy on Twisted with pluggable drain strategies."""

__version__ = "0.1.0"
