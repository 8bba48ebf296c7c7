"""ztunnel-control-plane: a lab control plane serving delta xDS and the Istio CA from a mesh YAML.

LAB AND TEST COMPONENT, NOT A PRODUCTION CONTROL PLANE. It authenticates no
one beyond an optional shared bearer token, signs whatever identity a CSR
asks for, keeps everything in memory and serves one mesh file. It exists so
that ztwisted and ztunnel can be fed by the same xDS server and CA in tests
and experiments.

It is a separate process and uses grpcio's server (threads); the proxy's
own clients speak gRPC over ztwisted's HTTP/2 stack on the reactor.

Serves, over TLS (``--listen``):
  /envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources
  /istio.v1.auth.IstioCertificateService/CreateCertificate
and an HTTP API (``--api``, plain HTTP on loopback, JSON):
  GET    /state                         mesh, streams (node, ACKs, NACKs), CSRs signed
  POST   /workloads                     add or replace a workload (local-config format, JSON)
  DELETE /workloads/NAME                remove a workload (by name, or uid with its slashes as %2F)
  POST   /workloads/NAME/unhealthy      mark it Unhealthy (POST .../healthy: back)
  POST   /invalid                       add a malformed Address resource (to watch NACKs)
  DELETE /invalid                       remove it
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import ipaddress
import json
import queue
import sys
import textwrap
import threading
import urllib.parse
from collections.abc import Iterator
from concurrent import futures
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import attrs
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from ztwisted.ca import CAError, CertificateAuthority, create_files
from ztwisted.config import ConfigError, parse_config
from ztwisted.xds import ca_pb2, discovery_pb2, workload_pb2
from ztwisted.xds.resources import ADDRESS_TYPE, AUTHORIZATION_TYPE, mesh_resources

INVALID_RESOURCE_NAME = "lab/invalid-address"
SERVING_CERT = "serving-cert.pem"
SERVING_KEY = "serving-key.pem"
ROOT_CERT = "root-cert.pem"


def _version(message) -> str:
    return hashlib.sha256(message.SerializeToString(deterministic=True)).hexdigest()[:16]


class MeshStore:
    """The mesh document (local-config format), the resources it makes, and the streams to tell."""

    def __init__(self, path: Path):
        self.path = path
        self.lock = threading.Lock()
        self.document = yaml.safe_load(path.read_text()) or {}
        self.invalid = False
        self.resources = self._build(self.document)
        self.listeners: list[queue.Queue] = []
        self.streams: dict[int, dict] = {}
        self.signed: list[dict] = []

    def _build(self, document) -> dict[str, dict[str, tuple[str, object]]]:
        mesh = parse_config(yaml.safe_dump(document), str(self.path))
        built = {
            type_url: {name: (_version(message), message) for name, message in by_name.items()}
            for type_url, by_name in mesh_resources(mesh).items()
        }
        if self.invalid:
            # Five address bytes: neither IPv4 nor IPv6.
            bad = workload_pb2.Address(
                workload=workload_pb2.Workload(
                    uid=INVALID_RESOURCE_NAME, name="invalid", namespace="lab", addresses=[b"\x0a\x00\x00\x01\x02"]
                )
            )
            built[ADDRESS_TYPE][INVALID_RESOURCE_NAME] = (_version(bad), bad)
        return built

    def change(self, edit) -> None:
        """Apply ``edit(document)`` to a copy; ConfigError (nothing changes) if the result is not a valid mesh."""
        with self.lock:
            document = copy.deepcopy(self.document)
            edit(document)
            self.resources = self._build(document)
            self.document = document
            listeners = list(self.listeners)
        for q in listeners:
            q.put(("changed", None))

    def set_invalid(self, present: bool) -> None:
        def edit(_document):
            self.invalid = present

        self.change(edit)

    def snapshot(self):
        with self.lock:
            return {t: dict(v) for t, v in self.resources.items()}


def _find_workload(document, name: str) -> dict:
    name = urllib.parse.unquote(name)  # a uid has slashes: they come percent-encoded
    for workload in document.get("workloads", []):
        if name in (workload.get("uid"), workload.get("name")):
            return workload
    raise KeyError(f"no workload named {name!r}")


def check_token(context, token: str | None) -> None:
    """With --token, a call must carry ``authorization: Bearer <token>`` (as ztunnel sends its service account token)."""
    import grpc

    if token is None:
        return
    sent = dict(context.invocation_metadata()).get("authorization")
    if sent != f"Bearer {token}":
        context.abort(
            grpc.StatusCode.UNAUTHENTICATED,
            "no bearer token" if sent is None else "the bearer token is not the one this control plane expects",
        )


@attrs.define
class _AdsStream:
    """One DeltaAggregatedResources stream: its entry in /state, its queue of events, and what its client holds.

    Events are ``("request", request)``, ``("changed", None)`` when the mesh
    changed, and ``("end", None)`` when the client's side of the stream ended.
    """

    info: dict
    events: queue.Queue = attrs.field(factory=queue.Queue)
    #: per type URL subscribed to: the client's resources, name -> version
    sent: dict[str, dict[str, str]] = attrs.field(factory=dict)
    nonces: Iterator[int] = attrs.field(factory=lambda: iter(range(1, 1 << 62)))


def _read_requests(requests, events: queue.Queue) -> None:
    """Put the client's requests on the stream's queue as they come (gRPC's iterator blocks), then its end."""
    try:
        for request in requests:
            events.put(("request", request))
    except Exception:
        pass  # a broken stream ends like a closed one
    events.put(("end", None))


class AdsServicer:
    """DeltaAggregatedResources: wildcard subscriptions, full state then deltas, removals on resume."""

    def __init__(self, store: MeshStore, token: str | None):
        self.store = store
        self.token = token
        self._ids = iter(range(1, 1 << 62))

    def __call__(self, requests, context):
        check_token(context, self.token)
        stream = self._open(context)
        threading.Thread(target=_read_requests, args=(requests, stream.events), daemon=True).start()
        try:
            while True:
                kind, request = stream.events.get()
                if kind == "end":
                    return
                if kind == "request":
                    yield from self._answer(request, stream)
                else:  # the mesh changed: every subscribed type gets what changed for it
                    for type_url in list(stream.sent):
                        response = self._delta(type_url, stream.sent, next(stream.nonces))
                        if response is not None:
                            yield response
        finally:
            stream.info["open"] = False
            with self.store.lock:
                self.store.listeners.remove(stream.events)

    def _open(self, context) -> _AdsStream:
        """A new stream, shown in /state and told of mesh changes."""
        stream_id = next(self._ids)
        stream = _AdsStream(
            info={
                "peer": context.peer(),
                "node": None,
                "acks": 0,
                "nacks": [],
                "open": True,
                "metadata": {k: v for k, v in context.invocation_metadata() if k != "authorization"},
            }
        )
        with self.store.lock:
            self.store.listeners.append(stream.events)
            self.store.streams[stream_id] = stream.info
        return stream

    def _answer(self, request, stream: _AdsStream):
        """Count an ACK or NACK of a response; answer a type's first subscription with what the client lacks."""
        info = stream.info
        if request.HasField("node"):
            info["node"] = request.node.id
        if request.response_nonce:
            if request.HasField("error_detail"):
                info["nacks"].append(
                    {
                        "type_url": request.type_url,
                        "nonce": request.response_nonce,
                        "error": request.error_detail.message,
                    }
                )
            else:
                info["acks"] += 1
            return
        if request.type_url in (ADDRESS_TYPE, AUTHORIZATION_TYPE) and request.type_url not in stream.sent:
            # First request of this type: the client's versions say what it holds.
            stream.sent[request.type_url] = dict(request.initial_resource_versions)
            response = self._delta(request.type_url, stream.sent, next(stream.nonces), force=True)
            if response is not None:
                yield response

    def _delta(self, type_url, sent, nonce, force=False):
        current = self.store.snapshot()[type_url]
        known = sent[type_url]
        response = discovery_pb2.DeltaDiscoveryResponse(type_url=type_url, nonce=str(nonce))
        for name, (version, message) in sorted(current.items()):
            if known.get(name) != version:
                resource = response.resources.add(name=name, version=version)
                resource.resource.Pack(message)
        response.removed_resources.extend(sorted(set(known) - set(current)))
        sent[type_url] = {name: version for name, (version, _) in current.items()}
        if not force and not response.resources and not response.removed_resources:
            return None
        return response


class CertificateServicer:
    """CreateCertificate: signs the CSR's SPIFFE identity (lab: no token review)."""

    def __init__(self, store: MeshStore, ca: CertificateAuthority, max_ttl: float | None, token: str | None):
        self.store, self.ca, self.max_ttl, self.token = store, ca, max_ttl, token

    def __call__(self, request, context):
        import grpc

        metadata = dict(context.invocation_metadata())
        check_token(context, self.token)
        try:
            csr = x509.load_pem_x509_csr(request.csr.encode())
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the CSR is not PEM: {e}")
        ttl = request.validity_duration or 24 * 3600
        if self.max_ttl is not None:
            ttl = min(ttl, self.max_ttl)
        try:
            leaf = self.ca.sign_csr(csr, timedelta(seconds=ttl))
        except CAError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        sans = [str(n.value) for n in leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value]
        with self.store.lock:
            self.store.signed.append(
                {
                    "peer": context.peer(),
                    "sans": sans,
                    "serial": format(leaf.serial_number, "x"),
                    "ttl": ttl,
                    "clusterid": metadata.get("clusterid"),
                }
            )
        pem = serialization.Encoding.PEM
        chain = [leaf.public_bytes(pem).decode()] + [c.public_bytes(pem).decode() for c in self.ca.chain]
        if self.ca.roots[0] not in self.ca.chain:
            chain.append(self.ca.roots[0].public_bytes(pem).decode())
        return ca_pb2.IstioCertificateResponse(cert_chain=chain)


def serving_certificate(ca: CertificateAuthority, names: list[str], directory: Path) -> tuple[bytes, bytes]:
    """A TLS server certificate for the control plane's names (IP and DNS SANs), written next to the CA."""
    key = ec.generate_private_key(ec.SECP256R1())
    sans = []
    for name in names:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            sans.append(x509.DNSName(name))
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([]))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .sign(key, hashes.SHA256())
    )
    leaf = ca.sign_csr(csr, timedelta(days=30))
    pem = serialization.Encoding.PEM
    cert_pem = leaf.public_bytes(pem) + ca.chain_pem
    key_pem = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    (directory / SERVING_CERT).write_bytes(cert_pem)
    (directory / SERVING_KEY).write_bytes(key_pem)
    (directory / ROOT_CERT).write_bytes(ca.roots_pem)
    return cert_pem, key_pem


class ApiHandler(BaseHTTPRequestHandler):
    store: MeshStore

    def log_message(self, format, *args):
        sys.stderr.write("api: " + format % args + "\n")

    def _answer(self, status: int, body) -> None:
        data = json.dumps(body, indent=1, default=str).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _change(self, edit) -> None:
        try:
            self.store.change(edit)
        except (ConfigError, KeyError, ValueError) as e:
            self._answer(400, {"error": str(e)})
            return
        self._answer(200, {"ok": True})

    def do_GET(self):
        if self.path != "/state":
            self._answer(404, {"error": f"no {self.path}"})
            return
        store = self.store
        with store.lock:
            body = {
                "resources": {t: {n: v for n, (v, _) in sorted(r.items())} for t, r in store.resources.items()},
                "streams": list(store.streams.values()),
                "signed": list(store.signed),
            }
        self._answer(200, body)

    def do_POST(self):
        parts = self.path.strip("/").split("/")
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length) if length else b""
        if parts == ["workloads"]:
            try:
                workload = json.loads(body)
            except ValueError as e:
                self._answer(400, {"error": f"not JSON: {e}"})
                return

            def add(document):
                workloads = document.setdefault("workloads", [])
                workloads[:] = [w for w in workloads if w.get("name") != workload.get("name")]
                workloads.append(workload)

            self._change(add)
        elif len(parts) == 3 and parts[0] == "workloads" and parts[2] in ("unhealthy", "healthy"):
            self._change(
                lambda document: _find_workload(document, parts[1]).__setitem__(
                    "status", "Unhealthy" if parts[2] == "unhealthy" else "Healthy"
                )
            )
        elif parts == ["invalid"]:
            self.store.set_invalid(True)
            self._answer(200, {"ok": True})
        else:
            self._answer(404, {"error": f"no {self.path}"})

    def do_DELETE(self):
        parts = self.path.strip("/").split("/")
        if len(parts) == 2 and parts[0] == "workloads":

            def remove(document):
                found = _find_workload(document, parts[1])
                document["workloads"].remove(found)

            self._change(remove)
        elif parts == ["invalid"]:
            self.store.set_invalid(False)
            self._answer(200, {"ok": True})
        else:
            self._answer(404, {"error": f"no {self.path}"})


class ControlPlaneProcess:
    """One ``ztunnel-control-plane`` process (in the named network namespace ``netns`` if given), and its API.

    The drain lab and the tests start it this way; ``root_cert`` is what the
    proxies take as their XDS and CA root.
    """

    def __init__(self, workdir: Path, mesh: Path, *, listen: str, api: str, netns: str | None = None, extra=()):
        self.workdir = Path(workdir)
        self.mesh = Path(mesh)
        self.listen = listen
        self.api_address = api
        self.netns = netns
        self.extra = tuple(extra)
        self.state_dir = self.workdir / "control-plane"
        self.root_cert = self.state_dir / ROOT_CERT
        self.log_path = self.workdir / "control-plane.log"
        self.process = None
        self._log = None

    @property
    def address(self) -> str:
        """What ``XDS_ADDRESS`` / ``--xds-address`` (and the CA's) take."""
        return f"https://{self.listen}"

    def start(self, timeout: float = 30.0) -> ControlPlaneProcess:
        import subprocess
        import time

        self.workdir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        argv = [
            sys.executable,
            "-m",
            "ztwisted.tools.control_plane",
            "--mesh",
            str(self.mesh),
            "--listen",
            self.listen,
            "--api",
            self.api_address,
            "--state-dir",
            str(self.state_dir),
            *self.extra,
        ]
        if self.netns:
            argv = ["ip", "netns", "exec", self.netns, *argv]
        self.process = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the control plane exited with {self.process.returncode}:\n{self.log_path.read_text()}"
                )
            try:
                if self.api("GET", "/state")[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"the control plane's API did not answer within {timeout} s (log: {self.log_path})")

    def api(self, method: str, path: str, body: dict | None = None, timeout: float = 10.0) -> tuple[int, object]:
        """(status, JSON body, or text if it is not JSON) of one call to the HTTP API."""
        from ztwisted.tools.harness import http_request

        status, data = http_request(
            f"http://{self.api_address}{path}",
            method,
            netns=self.netns,
            timeout=timeout,
            body=json.dumps(body).encode() if body is not None else None,
        )
        try:
            return status, json.loads(data)
        except ValueError:
            return status, data.decode(errors="replace")

    def state(self) -> dict:
        status, body = self.api("GET", "/state")
        if status != 200:
            raise RuntimeError(f"the control plane's /state answered {status}: {body}")
        return body

    def stop(self) -> None:
        """SIGKILL: it keeps nothing worth a clean exit (tests use this to cut streams mid-traffic)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self.process = None
        if self._log is not None:
            self._log.close()
            self._log = None


def _host_port(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    return host.strip("[]"), int(port)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    state_dir = Path(args.state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    try:
        ca_dir = state_dir / "ca"
        ca = CertificateAuthority.load(ca_dir) if (ca_dir / "ca-key.pem").exists() else create_files(ca_dir)
    except CAError as e:
        parser.exit(2, f"ztunnel-control-plane: certificate authority: {e}\n")
    try:
        store = MeshStore(Path(args.mesh))
    except ConfigError as e:
        parser.exit(2, f"ztunnel-control-plane: bad mesh:\n{e}\n")
    host, _ = _host_port(args.listen)
    cert_pem, key_pem = serving_certificate(
        ca, [host, "localhost", "istiod.istio-system.svc", *args.server_name], state_dir
    )
    server = _grpc_server(store, ca, args, key_pem, cert_pem)
    server.start()
    _serve_api(store, args.api)
    print(
        f"ztunnel-control-plane (lab/test only): xDS and CA on https://{args.listen}, API on http://{args.api}, "
        f"root certificate {state_dir / ROOT_CERT}",
        flush=True,
    )
    try:
        server.wait_for_termination()
    except KeyboardInterrupt:
        pass
    server.stop(0)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ztunnel-control-plane",
        description=textwrap.fill(
            "A LAB AND TEST control plane, NOT for production: serves delta xDS (workloads, services, "
            "authorization policies) and the Istio CA service from a mesh YAML (ztunnel's local config format), "
            "with an HTTP API to add, remove and mark pods unhealthy. It signs any identity a CSR asks for.",
            79,
        ),
        # The served methods and the HTTP API, from this module's docstring.
        epilog="Serves" + __doc__.split("\nServes", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--mesh", required=True, help="mesh YAML (the format of twistd ztunnel --config / LOCAL_XDS_PATH)"
    )
    parser.add_argument("--listen", default="127.0.0.1:15012", help="gRPC over TLS: xDS and CA [%(default)s]")
    parser.add_argument(
        "--api", default="127.0.0.1:15014", help="HTTP API, plain HTTP: keep it on loopback [%(default)s]"
    )
    parser.add_argument(
        "--state-dir",
        required=True,
        help="its CA (plug-in layout in ca/), serving certificate and "
        "root-cert.pem (give that to proxies as XDS_ROOT_CA and CA_ROOT_CA)",
    )
    parser.add_argument(
        "--server-name",
        action="append",
        default=[],
        help="more names for the serving certificate (the listen address is always in it)",
    )
    parser.add_argument(
        "--cert-ttl",
        type=float,
        default=None,
        help="the longest workload certificate it signs, in seconds (short ones exercise renewal)",
    )
    parser.add_argument(
        "--token",
        default=None,
        help="require this bearer token on xDS and CA calls "
        "(ztunnel sends AUTH_TOKEN's token as authorization: Bearer ...)",
    )
    return parser


def _grpc_server(store: MeshStore, ca: CertificateAuthority, args: argparse.Namespace, key_pem: bytes, cert_pem: bytes):
    """The gRPC server (not started yet) of xDS and the CA on ``--listen``, over TLS with the serving certificate."""
    import grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
    ads = grpc.stream_stream_rpc_method_handler(
        AdsServicer(store, args.token),
        request_deserializer=discovery_pb2.DeltaDiscoveryRequest.FromString,
        response_serializer=discovery_pb2.DeltaDiscoveryResponse.SerializeToString,
    )
    create = grpc.unary_unary_rpc_method_handler(
        CertificateServicer(store, ca, args.cert_ttl, args.token),
        request_deserializer=ca_pb2.IstioCertificateRequest.FromString,
        response_serializer=ca_pb2.IstioCertificateResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "envoy.service.discovery.v3.AggregatedDiscoveryService", {"DeltaAggregatedResources": ads}
            ),
            grpc.method_handlers_generic_handler(
                "istio.v1.auth.IstioCertificateService", {"CreateCertificate": create}
            ),
        )
    )
    server.add_secure_port(args.listen, grpc.ssl_server_credentials([(key_pem, cert_pem)]))
    return server


def _serve_api(store: MeshStore, address: str) -> None:
    """The HTTP API on ``address``, served from a thread of its own."""
    ApiHandler.store = store
    api_host, api_port = _host_port(address)
    api = ThreadingHTTPServer((api_host, api_port), ApiHandler)
    threading.Thread(target=api.serve_forever, daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())
