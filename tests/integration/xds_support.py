"""Support for the xDS tests: HTTP and SOCKS5 probes that may run in a namespace.

The control plane process is :class:`ztwisted.tools.control_plane.ControlPlaneProcess`
(the drain lab starts it too).

The probes run as this module's command line inside a namespace
(``ip netns exec NS python -m tests.integration.xds_support http|socks ...``)
and print one JSON line; that part uses the standard library and
``ztwisted.tools.harness`` (standard library only) alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

from ztwisted.tools.harness import Socks5Refused, socks5_connect

REPO_ROOT = Path(__file__).resolve().parents[2]


def deny_policy(name: str, service_account: str) -> str:
    """A mesh YAML ``policies:`` entry: a WorkloadSelector Deny of ``default/<service_account>``'s identity."""
    return (
        f"- name: {name}\n  namespace: default\n  scope: WorkloadSelector\n  action: Deny\n  rules:\n"
        f'  - - - principals: ["spiffe://cluster.local/ns/default/sa/{service_account}"]\n'
    )


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
