"""``twistd ztunnel``: options and the service tree of one node proxy."""

from __future__ import annotations

import atexit
import gc
import logging
import os
import random
import signal
import sys
from collections.abc import Callable

import attrs
from twisted.application import service
from twisted.application.internet import TimerService
from twisted.internet import reactor as global_reactor
from twisted.logger import FilteringLogObserver, ILogObserver, Logger, PredicateResult
from twisted.python import usage
from twisted.web.server import Site

from ztwisted import __version__
from ztwisted.admin import AdminActions, admin_resource, metrics_resource, readiness_resource
from ztwisted.ca import CAError, CertificateAuthority, CertificateStore
from ztwisted.config import ConfigError, ConfigWatcher, builtin_example_path, load_config
from ztwisted.context import NodeSettings, ProxyContext
from ztwisted.drain.admin import drain_admin_routes
from ztwisted.drain.controller import DrainController, drain_timeout_from_environment
from ztwisted.drain.facade import DrainDeadline
from ztwisted.drain.registry import DEFAULT_STRATEGY, UnknownStrategy, describe, select
from ztwisted.dump import ConfigDump
from ztwisted.endpoints import listener_service
from ztwisted.inpod import DEFAULT_SOCKET_PATH
from ztwisted.logs import observer_for
from ztwisted.metrics import Metrics
from ztwisted.model import Mesh
from ztwisted.network import HostNetwork
from ztwisted.node import Node
from ztwisted.readiness import Readiness
from ztwisted.reconcile import MeshReconciler
from ztwisted.sockets import (
    GIVE_BACK_INTERVAL,
    CannotListen,
    allow_accept_queue_migration,
    give_back_freed_memory,
    is_port_noise,
    keep_read_buffers_in_the_heap,
)
from ztwisted.view import NodeView
from ztwisted.workloads import LocalWorkloads
from ztwisted.xds import settings as xds_settings

log = Logger()

#: where --drain-strategy help sends the reader: the Sphinx docs in the source (`tox -e docs` builds them)
DRAINING_DOCS = "docs/draining.rst and docs/strategies/NAME.rst in ztwisted's source"
#: ztunnel's mark on its own traffic, so a pod's redirect rules can let it pass
DEFAULT_PACKET_MARK = 1337


def default_state_dir() -> str:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "ztwisted")


def _port(value: str) -> int:
    port = int(value)
    if not 0 < port < 65536:
        raise ValueError(f"{value} is not a TCP port")
    return port


def _positive_seconds(value: str) -> float:
    seconds = float(value)
    # Zero would make a timer that re-arms at once: a busy loop, not "off".
    if not seconds > 0:
        raise ValueError(f"{value} is not a positive number of seconds")
    return seconds


class Options(usage.Options):
    synopsis = "[options]"
    longdesc = (
        "An HBONE node proxy compatible with Istio's ztunnel. Without --config it runs a built-in "
        "example mesh (see the README); without --ca-dir it makes a development CA in --state-dir."
    )
    optParameters = [
        ["config", "c", None, "ztunnel local config YAML (LOCAL_XDS_PATH format); reloaded when it changes."],
        ["node", None, None, "Node name: workloads whose `node` equals it are local (default: every workload)."],
        [
            "state-dir",
            None,
            None,
            "Directory for state such as the development CA (default: $XDG_STATE_HOME/ztwisted).",
        ],
        ["ca-dir", None, None, "Istio plug-in CA directory (ca-cert.pem, ca-key.pem, root-cert.pem, cert-chain.pem)."],
        ["socks5", None, "tcp:15080:interface=127.0.0.1", "SOCKS5 outbound listener (endpoint description)."],
        ["outbound", None, "tcp:15001", "Redirected outbound listener (endpoint description)."],
        ["admin", None, "tcp:15000:interface=127.0.0.1", "Admin listener: /config_dump, POST /quitquitquit."],
        ["metrics", None, "tcp:15020", "Prometheus metrics listener: /metrics, /stats/prometheus."],
        ["readiness", None, "tcp:15021", "Readiness listener: /healthz/ready."],
        ["hbone-port", None, 15008, "HBONE inbound port, bound on each local workload IP.", _port],
        ["inbound-plaintext-port", None, 15006, "Plaintext inbound port, bound on each local workload IP.", _port],
        ["log-format", None, "text", "Log format: json or text."],
        [
            "drain-timeout",
            None,
            None,
            "Seconds to wait for connections when the proxy stops "
            "(default: from TERMINATION_GRACE_PERIOD_SECONDS as ztunnel does, else 5).",
        ],
        ["connect-timeout", None, 10.0, "Seconds to connect to a peer (TCP and TLS).", float],
        [
            "pod-drain-timeout",
            None,
            3.0,
            "Seconds a pod-removal drain may take (keep it under the node agent's Ack timeout).",
            float,
        ],
        [
            "inpod-uds",
            None,
            None,
            f"In-pod mode: the node agent's ZDS socket (default when --inpod: {DEFAULT_SOCKET_PATH}).",
        ],
        [
            "packet-mark",
            None,
            None,
            "SO_MARK on every socket the proxy opens (default: 1337 in in-pod mode, none otherwise).",
            int,
        ],
        [
            "random-seed",
            None,
            None,
            "Seed the proxy's random choices (endpoint selection, backoff jitter): for reproducible labs.",
            int,
        ],
        [
            "keepalive-interval",
            None,
            10.0,
            "Seconds without frames from an HBONE peer before a PING.",
            _positive_seconds,
        ],
        ["keepalive-timeout", None, 20.0, "Seconds to wait for a PING answer before closing.", _positive_seconds],
        # xDS and CA client settings (ztunnel's environment variable names): ztwisted/xds/settings.py
        *xds_settings.option_parameters(),
    ]

    optFlags = [
        ["inpod", None, "In-pod mode: the node agent (ZDS) adds pods and their network namespaces."],
    ]

    def opt_version(self):
        print(f"ztwisted {__version__}")
        sys.exit(0)

    def __init__(self):
        super().__init__()
        self["drain-strategy"] = DEFAULT_STRATEGY

    def _defaults_from_ztunnel_environment(self, environ=os.environ) -> None:
        """ztunnel's environment variables, for options not given on the command line."""
        if self["config"] is None and environ.get("LOCAL_XDS_PATH"):
            self["config"] = environ["LOCAL_XDS_PATH"]
        if self["node"] is None and environ.get("NODE_NAME"):
            self["node"] = environ["NODE_NAME"]
        if self["inpod-uds"] is None and environ.get("INPOD_UDS"):
            self["inpod-uds"] = environ["INPOD_UDS"]
        if not self["inpod"] and environ.get("INPOD_ENABLED", "").lower() == "true":
            self["inpod"] = True
        if self["packet-mark"] is None and environ.get("INPOD_MARK"):
            self["packet-mark"] = int(environ["INPOD_MARK"])

    def opt_drain_strategy(self, spec: str) -> None:
        """Drain strategies, comma separated; `help` lists the installed ones [default: immediate]."""
        if spec == "help":
            print("How connections end when a pod or the proxy shuts down. Installed drain strategies")
            print("(compose with commas, e.g. client-evict,last-mile):")
            print(describe())
            print(f"\nHow draining works, and a page per built-in strategy: {DRAINING_DOCS}")
            sys.exit(0)
        self["drain-strategy"] = spec

    def postOptions(self) -> None:
        self._defaults_from_ztunnel_environment()
        try:
            self.strategies = select(self["drain-strategy"])
        except UnknownStrategy as e:
            # The error and the names, on stderr: twistd's usage text would bury them.
            raise SystemExit(f"ztunnel: --drain-strategy: {e} (--drain-strategy help describes them)") from None
        if self["log-format"] not in ("json", "text"):
            raise usage.UsageError(f"--log-format must be json or text, not {self['log-format']!r}")
        if self["drain-timeout"] is not None:
            try:
                self["drain-timeout"] = float(self["drain-timeout"])
            except ValueError:
                raise usage.UsageError(
                    f"--drain-timeout must be a number of seconds, not {self['drain-timeout']!r}"
                ) from None
        else:
            self["drain-timeout"] = drain_timeout_from_environment()
        if self["inpod-uds"]:
            self["inpod"] = True
        if self["inpod"]:
            self["inpod-uds"] = self["inpod-uds"] or DEFAULT_SOCKET_PATH
            if self["packet-mark"] is None:
                self["packet-mark"] = DEFAULT_PACKET_MARK
        if self["packet-mark"] == 0:
            self["packet-mark"] = None
        if self["state-dir"] is None:
            self["state-dir"] = default_state_dir()
        xds_settings.apply_environment(self)
        try:
            # In xDS mode the mesh starts empty and readiness waits for the first push.
            self.mesh = Mesh() if self["xds-address"] else load_config(self["config"] or builtin_example_path())
        except ConfigError as e:
            # Not a usage mistake: the error alone, without twistd's whole usage text.
            raise SystemExit(f"ztunnel: bad configuration:\n{e}") from None
        try:
            if self["ca-address"]:
                # Certificates come from the CA service: no CA key on this node.
                self.certificate_authority = None
            elif self["ca-dir"]:
                self.certificate_authority = CertificateAuthority.load(self["ca-dir"])
            else:
                self.certificate_authority = CertificateAuthority.load_or_create_dev(self["state-dir"])
        except CAError as e:
            raise SystemExit(f"ztunnel: certificate authority: {e}") from None
        if self["node"] and not self["xds-address"] and not self.mesh.local_workloads(self["node"]):
            log.warn("no workload in the configuration has node {node!r}", node=self["node"])


class ProxyService(service.MultiService):
    """The root service: picks the log format when twistd attaches it to the application, turns a
    listener that cannot open into one line and exit status 1, and makes a second SIGTERM/SIGINT
    during the drain stop at once (``proxy`` is None only for a root without a node, in tests)."""

    def __init__(
        self,
        log_format: str,
        reactor,
        proxy: Proxy | None = None,
        *,
        logs_to_stdout: bool = True,
        freeze_heap: Callable[[], None] = gc.freeze,
        give_back_memory: Callable[[], None] = give_back_freed_memory,
    ):
        super().__init__()
        self.log_format = log_format
        self.logs_to_stdout = logs_to_stdout
        self.reactor = reactor
        self.proxy = proxy
        self._freeze_heap = freeze_heap
        self._give_back_memory = give_back_memory
        self._is_the_process = False
        self._stopping = False

    def privilegedStartService(self):
        try:
            super().privilegedStartService()
        except CannotListen as e:
            # One line naming the option and the address, not twistd's traceback.
            log.critical("cannot start: {error}", error=str(e))
            raise SystemExit(1) from None

    def startService(self):
        super().startService()
        if self._is_the_process:
            # What start-up made (modules, configuration, listeners; ~64,000 objects) is
            # hardly ever garbage, yet each full collection scanned it all, stopping every
            # connection of the node for 30-75 ms under connection churn. Frozen, it is left
            # out of the collector's scans; what is garbage already is collected first.
            gc.collect()
            self._freeze_heap()
        if self.proxy is None:
            return
        log.info(
            "node proxy ready: {count} local workloads, drain strategies {strategies}",
            count=len(self.proxy.node.workloads.all()),
            strategies=self.proxy.drain.coordinator.names,
        )
        if self.reactor is global_reactor:
            # After the reactor installed its own handlers, which stay in charge of the first signal.
            self.reactor.callLater(0, self._chain_signal_handlers)

    def stopService(self):
        self._stopping = True
        return super().stopService()

    def _chain_signal_handlers(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous = signal.getsignal(signum)

            def handler(number, frame, previous=previous):
                if self._stopping:
                    self.reactor.callFromThread(self.proxy.drain.stop_now)
                elif callable(previous):
                    previous(number, frame)

            signal.signal(signum, handler)

    def setServiceParent(self, parent):
        if hasattr(parent, "setComponent"):  # twistd's application: this service is the process
            self._is_the_process = True
            # JSON always goes to stdout; text does when twistd would put it there (-n without
            # --logfile or --syslog), else twistd's own observer stays.
            if self.log_format == "json" or self.logs_to_stdout:
                observer = observer_for(self.log_format, sys.stdout)
                parent.setComponent(ILogObserver, FilteringLogObserver(observer, [_without_port_noise]))
            if self.reactor is global_reactor:
                _ExitWithoutTeardown(self.reactor)
            if keep_read_buffers_in_the_heap():
                # What the heap keeps after a burst of bulk tunnels goes back to the kernel.
                giving_back = TimerService(GIVE_BACK_INTERVAL, self._give_back_memory)
                giving_back.clock = self.reactor
                giving_back.setServiceParent(self)
        return super().setServiceParent(parent)


class _ExitWithoutTeardown:
    """Once the reactor has stopped cleanly, the process ends without Python's interpreter teardown.

    After SIGTERM or SIGINT twistd re-raises the signal, which ends the process
    at once. A stop without a signal (``POST /quitquitquit``) returns to
    Python, whose teardown of the ~60,000 objects of an idle proxy took 0.1 s
    on a quiet machine and 0.8 s on a loaded one, after "Server Shut Down.":
    time in which the process is done but has not exited.
    """

    def __init__(self, reactor):
        self.stopped = False
        reactor.addSystemEventTrigger("after", "shutdown", self._stopped)
        # Registered now, before twistd runs, so that any handler registered later runs first.
        atexit.register(self._exit)

    def _stopped(self) -> None:
        self.stopped = True

    def _exit(self) -> None:
        if not self.stopped or hasattr(sys, "last_value"):
            return  # no clean stop (an uncaught exception, a start-up error): Python ends as usual
        logging.shutdown()  # the one handler the standard library registered before this one
        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            try:
                stream.flush()
            except (AttributeError, OSError, ValueError):
                pass
        os._exit(0)


def _without_port_noise(event) -> PredicateResult:
    return PredicateResult.no if is_port_noise(event) else PredicateResult.maybe


def _twistd_logs_to_stdout(config: Options) -> bool:
    """Whether twistd's options (the parent of ours) send the log to stdout."""
    twistd = getattr(config, "parent", None)
    if twistd is None:
        return True
    return (
        bool(twistd.get("nodaemon"))
        and twistd.get("logfile") in (None, "-")
        and not twistd.get("syslog")
        and not twistd.get("logger")
    )


class _ConfigWatchService(service.Service):
    def __init__(self, watcher: ConfigWatcher):
        self.watcher = watcher

    def startService(self):
        super().startService()
        self.watcher.start()

    def stopService(self):
        self.watcher.stop()
        return super().stopService()


@attrs.define
class Proxy:
    """One node proxy, composed: the node, its drain layer on top, and what admin shows."""

    node: Node
    view: NodeView
    drain: DrainController
    readiness: Readiness
    config_dump: ConfigDump
    #: applies a new mesh (a reloaded file, an xDS push) to the node
    reconciler: MeshReconciler


def compose(config: Options, metrics: Metrics, reactor) -> Proxy:
    """The node (listeners, pool) and the drain controller above it, wired through the node's view."""
    settings = NodeSettings(
        hbone_port=config["hbone-port"],
        plaintext_port=config["inbound-plaintext-port"],
        connect_timeout=config["connect-timeout"],
        keepalive=(config["keepalive-interval"], config["keepalive-timeout"]),
    )
    host = HostNetwork(reactor, mark=config["packet-mark"])
    workloads = LocalWorkloads(config.mesh, config["node"], host, inpod=bool(config["inpod"]))
    # A remote CA's client (ztwisted.xds.certificates) with --ca-address; else issued here by the local CA.
    certificates = xds_settings.remote_certificates(config, reactor)
    if certificates is None:
        certificates = CertificateStore(config.certificate_authority, reactor)
    context = ProxyContext(reactor, metrics, certificates, workloads, settings, random.Random(config["random-seed"]))
    readiness = Readiness()
    node = Node(context, readiness)
    view = NodeView(node)
    deadline = DrainDeadline(reactor, config["drain-timeout"], config["pod-drain-timeout"])
    drain = DrainController(view, config.strategies, metrics, deadline, readiness)
    drain.setServiceParent(node)
    config_source = config["xds-address"] or config["config"] or "<built-in example>"
    dump = ConfigDump(node, view, config["node"], config_source)
    return Proxy(node, view, drain, readiness, dump, MeshReconciler(node, drain))


def _listen(config: Options, proxy: Proxy, metrics: Metrics, reactor) -> None:
    """The node-wide listeners, as children of the node."""
    if not allow_accept_queue_migration():
        log.info("could not set net.ipv4.tcp_migrate_req=1: a restart may reset connections waiting in accept queues")
    outbound = proxy.node.outbound
    admin = AdminActions(
        config_dump=proxy.config_dump,
        quit=reactor.stop,
        admin_routes=lambda: drain_admin_routes(proxy.view, proxy.drain),
    )
    for option, purpose, factory in [
        ("socks5", "SOCKS5 outbound", outbound.socks5_factory()),
        ("outbound", "redirected outbound", outbound.redirect_factory()),
        ("admin", "admin", Site(admin_resource(admin, reactor))),
        ("metrics", "metrics", Site(metrics_resource(metrics))),
        ("readiness", "readiness", Site(readiness_resource(proxy.readiness))),
    ]:
        description = config[option]
        if description and description != "none":
            listener_service(description, factory, reactor, purpose=purpose, option=f"--{option}").setServiceParent(
                proxy.node
            )


def _use_remote_certificates(proxy: Proxy, reactor) -> None:
    """With a CA client, readiness waits for every local identity's certificate, asked for as
    soon as its workload is known (the others are forgotten)."""
    from ztwisted.xds.certificates import RemoteCertificateStore

    certificates = proxy.node.context.certificates
    if not isinstance(certificates, RemoteCertificateStore):
        return
    workloads = proxy.node.workloads

    def identities():
        return {w.identity for w in workloads.all()}

    proxy.readiness.checks.append(lambda: [f"certificate {i}" for i in certificates.missing(identities())])
    proxy.config_dump.sections["ca"] = certificates.status
    workloads.on_local_workloads_changed.append(lambda: certificates.keep_only(identities()))
    reactor.callWhenRunning(lambda: certificates.keep_only(identities()))


def _join_xds(config: Options, proxy: Proxy, metrics: Metrics, root, reactor):
    """With --xds-address, the xDS client that feeds the node its mesh; returns it (else None)."""
    client = xds_settings.xds_client(
        config, reactor, on_mesh=proxy.reconciler.apply_mesh, random=proxy.node.context.random, metrics=metrics
    )
    if client is None:
        return None
    client.setServiceParent(root)
    proxy.readiness.checks.append(client.pending)
    proxy.config_dump.sections["xds"] = client.status
    return client


def _serve_node_agent(config: Options, proxy: Proxy, metrics: Metrics, root, reactor, xds) -> None:
    from ztwisted.inpod.client import ZdsClient
    from ztwisted.inpod.proxies import PodProxies

    zds = ZdsClient(reactor, config["inpod-uds"], PodProxies(proxy.node, proxy.drain), metrics)
    if xds is None:
        zds.setServiceParent(root)
    else:
        # Pods are matched to workloads by uid: take them from the node agent once discovery has them.
        xds.first_push.addCallback(lambda _: zds.setServiceParent(root))
    proxy.readiness.checks.append(lambda: [] if zds.ready() else ["node agent snapshot", *sorted(zds.pending())])
    proxy.config_dump.sections["inpod"] = zds.status


def _watch_config(config: Options, proxy: Proxy, metrics: Metrics, root, reactor) -> None:
    def reloaded(mesh):
        metrics.config_reloads.inc()
        log.info("configuration reloaded from {path}", path=config["config"])
        proxy.reconciler.apply_mesh(mesh)

    def rejected(error):
        metrics.config_reload_errors.inc()
        log.error("configuration change rejected, keeping the last good one: {error}", error=str(error))

    watcher = ConfigWatcher(config["config"], reloaded, rejected, reactor, current=config.mesh)
    _ConfigWatchService(watcher).setServiceParent(root)


def makeService(config: Options, reactor=global_reactor) -> service.IService:
    metrics = Metrics()
    proxy = compose(config, metrics, reactor)
    root = ProxyService(config["log-format"], reactor, proxy, logs_to_stdout=_twistd_logs_to_stdout(config))
    proxy.node.setServiceParent(root)
    _listen(config, proxy, metrics, reactor)
    _use_remote_certificates(proxy, reactor)
    xds = _join_xds(config, proxy, metrics, root, reactor)
    if config["inpod"]:
        _serve_node_agent(config, proxy, metrics, root, reactor, xds)
    if config["config"]:
        _watch_config(config, proxy, metrics, root, reactor)
    return root
