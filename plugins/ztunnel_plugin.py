"""The ``twistd ztunnel`` service maker (loaded lazily: importing it is cheap)."""

from twisted.application.service import ServiceMaker


class _ZtunnelServiceMaker(ServiceMaker):
    @property
    def options(self):
        # twistd asks for the options only when the ztunnel subcommand is used, after
        # it installed any reactor named with --reactor and before anything imports
        # the global reactor: the last moment to choose ztwisted's when none was named.
        from ztwisted.reactor import install_unless_chosen

        install_unless_chosen()
        return super().options


ztunnel = _ZtunnelServiceMaker(
    "ztwisted HBONE node proxy",
    "ztwisted.tap",
    "An Istio ztunnel compatible HBONE node proxy with pluggable drain strategies.",
    "ztunnel",
)
