"""xDS and CA settings under ztunnel's environment variable names, as ``twistd ztunnel`` options.

Each option falls back to ztunnel's variable (``XDS_ADDRESS``,
``CA_ADDRESS``, ``XDS_ROOT_CA``, ``CA_ROOT_CA``, ``AUTH_TOKEN``,
``CLUSTER_ID``, ``SECRET_TTL``, ``ALT_XDS_HOSTNAME``, ``ALT_CA_HOSTNAME``);
``XDS_HEADER_*``/``CA_HEADER_*``, ``ISTIO_META_*``, ``POD_NAME``,
``POD_NAMESPACE``, ``INSTANCE_IP`` and ``NODE_NAME`` are read from the
environment only, as ztunnel does. :func:`xds_client` and
:func:`remote_certificates` make the two clients; ``tap.py`` wires them to the node.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from twisted.python import usage

from ztwisted.xds import grpc

#: ztunnel's defaults, relative to its working directory as in ztunnel
DEFAULT_ROOT_CERT = "./var/run/secrets/istio/root-cert.pem"
DEFAULT_TOKEN = "./var/run/secrets/tokens/istio-token"
DEFAULT_CLUSTER_ID = "Kubernetes"

#: [option, environment variable, help]
OPTIONS = [
    [
        "xds-address",
        "XDS_ADDRESS",
        "xDS server (https://host:port): workloads, services and policies come from it "
        "instead of --config (delta ADS, as ztunnel).",
    ],
    [
        "ca-address",
        "CA_ADDRESS",
        "Istio CA (https://host:port) for workload certificates (default with "
        "--xds-address: the same address). The node then holds no CA key.",
    ],
    [
        "xds-root-ca",
        "XDS_ROOT_CA",
        f"Root certificate of the xDS server: a file, SYSTEM, or PEM text [{DEFAULT_ROOT_CERT}].",
    ],
    [
        "ca-root-ca",
        "CA_ROOT_CA",
        f"Root certificate of the CA server: a file, SYSTEM, or PEM text [{DEFAULT_ROOT_CERT}].",
    ],
    [
        "auth-token",
        "AUTH_TOKEN",
        f"Bearer token sent to xDS and CA: a file (re-read per connection) or the token "
        f"itself [{DEFAULT_TOKEN} if it exists].",
    ],
    ["cluster-id", "CLUSTER_ID", f"Cluster id, sent with the token as the clusterid header [{DEFAULT_CLUSTER_ID}]."],
    ["secret-ttl", "SECRET_TTL", "Workload certificate lifetime asked of the CA (e.g. 24h, 90m, 30s) [24h]."],
    ["alt-xds-hostname", "ALT_XDS_HOSTNAME", "Name the xDS server certificate must carry, if not the address's host."],
    ["alt-ca-hostname", "ALT_CA_HOSTNAME", "Name the CA server certificate must carry, if not the address's host."],
]

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """ztunnel's duration syntax (``24h``, ``1h30m``, ``500ms``, or plain seconds) in seconds."""
    text = text.strip()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"{text!r} is not a duration such as 24h, 90m or 30s")
    return sum(float(n) * _UNITS[u] for n, u in parts)


def option_parameters() -> list[list]:
    return [[name, None, None, f"{text} (env {env})"] for name, env, text in OPTIONS]


def apply_environment(options, environ=os.environ) -> None:
    """Fill options not given on the command line from ztunnel's variables, then check them."""
    for name, env, _ in OPTIONS:
        if options[name] is None and environ.get(env):
            options[name] = environ[env]
    if options["cluster-id"] is None:
        options["cluster-id"] = environ.get("ISTIO_META_CLUSTER_ID") or DEFAULT_CLUSTER_ID
    try:
        options["secret-ttl"] = parse_duration(options["secret-ttl"] or "24h")
    except ValueError as e:
        raise usage.UsageError(f"--secret-ttl: {e}") from None
    if options["xds-address"] and options["ca-address"] is None:
        options["ca-address"] = options["xds-address"]
    for name in ("xds-address", "ca-address"):
        if options[name]:
            try:
                grpc.Target.parse(options[name], None)
            except ValueError as e:
                raise usage.UsageError(f"--{name}: {e}") from None
    if options["ca-address"] and options["ca-dir"]:
        raise usage.UsageError("--ca-dir (a local CA) and --ca-address (a remote CA) exclude each other")
    if options["xds-address"] and options["config"]:
        raise usage.UsageError(
            "--config (LOCAL_XDS_PATH) and --xds-address (XDS_ADDRESS) exclude each other: "
            "the mesh comes from one of them"
        )


def _root(value: str | None) -> bytes | None:
    return grpc.read_root_setting(value or DEFAULT_ROOT_CERT)


def _headers(options, prefix: str, environ=os.environ):
    """The headers of each call: the token (read now, so a rotated file is used) and ``<prefix>*`` variables."""
    token_setting = options["auth-token"]
    # As ztunnel: the rest of the variable's name is the header's (lower case, underscores kept).
    extra = [(key[len(prefix) :].lower(), value) for key, value in environ.items() if key.startswith(prefix)]

    def headers() -> list[tuple[str, str]]:
        out = list(extra)
        setting = token_setting
        if setting is None and Path(DEFAULT_TOKEN).exists():
            setting = DEFAULT_TOKEN
        if setting is not None:
            path = Path(setting)
            token = path.read_text().strip() if path.exists() else setting
            if not token:
                raise OSError(f"the token file {setting} is empty")
            out += [("authorization", f"Bearer {token}"), ("clusterid", options["cluster-id"])]
        return out

    return headers


def node_info(options, environ=os.environ):
    from ztwisted.xds.client import NodeInfo

    meta = {key[len("ISTIO_META_") :]: value for key, value in environ.items() if key.startswith("ISTIO_META_")}
    return NodeInfo(
        instance_ip=environ.get("INSTANCE_IP", "1.1.1.1"),
        pod_name=environ.get("POD_NAME", ""),
        pod_namespace=environ.get("POD_NAMESPACE", ""),
        node_name=options["node"] or environ.get("NODE_NAME", ""),
        metadata=meta,
    )


def remote_certificates(options, reactor):
    """The CA client for ``--ca-address``, or None (local CA)."""
    if not options["ca-address"]:
        return None
    from ztwisted.xds.certificates import RemoteCertificateStore

    target = grpc.Target.parse(options["ca-address"], _root(options["ca-root-ca"]), options["alt-ca-hostname"])
    return RemoteCertificateStore(
        reactor, target, headers=_headers(options, "CA_HEADER_"), secret_ttl=options["secret-ttl"]
    )


def xds_client(options, reactor, *, on_mesh, random, metrics):
    """The xDS client for ``--xds-address`` (``on_mesh`` receives each accepted mesh), or None."""
    if not options["xds-address"]:
        return None
    from ztwisted.xds.client import XdsClient

    target = grpc.Target.parse(options["xds-address"], _root(options["xds-root-ca"]), options["alt-xds-hostname"])
    return XdsClient(
        reactor,
        target,
        node=node_info(options),
        on_mesh=on_mesh,
        headers=_headers(options, "XDS_HEADER_"),
        random=random,
        metrics=metrics,
    )
