"""Support for the xDS tests: the lab control plane process, HTTP and SOCKS5 probes that may run in a namespace.

The probes run as this module's command line inside a namespace
(``ip netns exec NS python -m tests.integration.xds_support http|socks ...``)
and print one JSON line; that part uses the standard library and
``ztwisted.tools.harness`` (standard library only) alone.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

from ztwisted.tools.harness import Socks5Refused, socks5_connect

REPO_ROOT = Path(__file__).resolve().parents[2]


def deny_policy(name: str, service_account: str) -> str:
    """A mesh YAML ``policies:`` entry: a WorkloadSelector Deny of ``default/<service_account>``'s identity."""
    return (f"- name: {name}\n  namespace: default\n  scope: WorkloadSelector\n  action: Deny\n  rules:\n"
            f'  - - - principals: ["spiffe://cluster.local/ns/default/sa/{service_account}"]\n')


def in_netns(netns: str | None, argv: list[str]) -> list[str]:
    return ["ip", "netns", "exec", netns, *argv] if netns else argv


def _probe(netns: str | None, *args: str, timeout: float = 30.0) -> dict:
    argv = in_netns(netns, [sys.executable, "-m", "tests.integration.xds_support", *args])
    result = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0 or not result.stdout.strip():
        raise RuntimeError(f"probe {args} in {netns or 'host'} failed ({result.returncode}): {result.stderr[-2000:]}")
    return json.loads(result.stdout)


def http_json(netns: str | None, url: str, method: str = "GET", body: dict | None = None) -> tuple[int, object]:
    """(status, JSON or text body) of one HTTP request, made from ``netns`` (None: here)."""
    if netns is None:
        return _http(url, method, json.dumps(body) if body is not None else "")
    answer = _probe(netns, "http", method, url, json.dumps(body) if body is not None else "")
    return answer["status"], answer["body"]


def socks_echo(netns: str, proxy: str, source: str, host: str, port: int, payload: str = "ping") -> dict:
    """Through the SOCKS5 proxy at ``proxy`` (host:port) from ``source``: {"ok": echoed, "error": ...}."""
    return _probe(netns, "socks", proxy, source, host, str(port), payload)


class ControlPlane:
    """One ``ztunnel-control-plane`` process (in ``netns`` if given)."""

    def __init__(self, workdir: Path, mesh: Path, *, listen: str, api: str, netns: str | None = None, extra=()):
        self.workdir = workdir
        self.mesh = mesh
        self.listen = listen
        self.api_address = api
        self.netns = netns
        self.extra = tuple(extra)
        self.state_dir = workdir / "control-plane"
        self.root_cert = self.state_dir / "root-cert.pem"
        self.log_path = workdir / "control-plane.log"
        self.process = None

    @property
    def address(self) -> str:
        return f"https://{self.listen}"

    def start(self) -> ControlPlane:
        from tests.support import wait_until

        self.workdir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        argv = [sys.executable, "-m", "ztwisted.tools.control_plane", "--mesh", str(self.mesh), "--listen", self.listen,
                "--api", self.api_address, "--state-dir", str(self.state_dir), *self.extra]
        self.process = subprocess.Popen(in_netns(self.netns, argv), stdout=self._log, stderr=subprocess.STDOUT)
        wait_until(self._answers, timeout=30, what="the control plane's API")
        return self

    def _answers(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"control plane exited:\n{self.log_path.read_text()}")
        try:
            return self.api("GET", "/state")[0] == 200
        except (OSError, RuntimeError):
            return False

    def api(self, method: str, path: str, body: dict | None = None) -> tuple[int, object]:
        return http_json(self.netns, f"http://{self.api_address}{path}", method, body)

    def state(self) -> dict:
        status, body = self.api("GET", "/state")
        assert status == 200, body
        return body

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)
        self.process = None


# -- the probes' own code ---------------------------------------------------------------------


def _http(url: str, method: str, body: str) -> tuple[int, object]:
    request = urllib.request.Request(url, data=body.encode() if body else None, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            status, data = response.status, response.read()
    except urllib.error.HTTPError as e:
        status, data = e.code, e.read()
    try:
        return status, json.loads(data)
    except ValueError:
        return status, data.decode(errors="replace")


def _socks_main(proxy: str, source: str, host: str, port: int, payload: str) -> dict:
    proxy_host, _, proxy_port = proxy.rpartition(":")
    try:
        sock = socks5_connect((proxy_host, int(proxy_port)), source, host, port)
    except Socks5Refused as e:
        return {"ok": False, "error": f"refused: {e}"}
    except OSError as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    with sock:
        sock.settimeout(10)
        try:
            sock.sendall(payload.encode())
            sock.shutdown(1)
            received = b""
            while chunk := sock.recv(65536):
                received += chunk
        except OSError as e:
            return {"ok": False, "error": f"after connecting: {type(e).__name__}: {e}"}
    return {"ok": received == payload.encode(), "error": "" if received == payload.encode() else f"got {received!r}"}


def main(argv: list[str]) -> None:
    mode, *args = argv
    if mode == "http":
        method, url, body = args
        status, answer = _http(url, method, body)
        print(json.dumps({"status": status, "body": answer}))
    elif mode == "socks":
        proxy, source, host, port, payload = args
        print(json.dumps(_socks_main(proxy, source, host, int(port), payload)))
    else:
        raise SystemExit(f"unknown probe {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
