#!/usr/bin/env python3
"""Build Istio's ztunnel from the archive in ``shared/peers/ztunnel`` and cache it.

ztunnel is a test peer, like Envoy and Node.js: this script builds and the
suite runs it, nothing of it is copied into the project. The release binary
and ztunnel's own node agent example (``inpodserver``) are cached outside
the clone, in a folder named after the archive, so a machine builds them
once and every later run (tox, CI, the lab, the benchmarks) reuses them.

Usage::

    python tests/peers/ztunnel_build.py          # build if needed, print the binary's path
    python tests/peers/ztunnel_build.py --where  # print the cached path only, exit 1 if absent

Environment:

``ZTWISTED_ZTUNNEL_ARCHIVE``
    the source archive (default: the newest ``ztunnel-*.tar.gz`` in
    ``../shared/peers/ztunnel/`` beside the clone).
``ZTWISTED_PEER_CACHE``
    the cache folder (default ``/var/cache/ztwisted``).

The build changes are those the peer's README names: the optional
``boring-rustls-provider`` git dependency and the ``tls-boring`` feature
are dropped from a copy of ``Cargo.toml`` (their host cannot be reached), and
the binary is built with ``--no-default-features --features tls-ring,testing``
(no aws-lc C build; ``testing`` is what ``FAKE_CA=true`` needs).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

FEATURES = "tls-ring,testing"
HERE = Path(__file__).resolve().parent


def default_archive() -> Path | None:
    """The archive named by the environment, or the newest one in shared/peers."""
    named = os.environ.get("ZTWISTED_ZTUNNEL_ARCHIVE")
    if named:
        return Path(named)
    for root in (HERE.parents[2], HERE.parents[1], Path("/work")):
        found = sorted((root / "shared" / "peers" / "ztunnel").glob("ztunnel-*.tar.gz"))
        if found:
            return found[-1]
    return None


def cache_dir(archive: Path) -> Path:
    base = Path(os.environ.get("ZTWISTED_PEER_CACHE", "/var/cache/ztwisted"))
    return base / archive.name.removesuffix(".tar.gz")


def binaries(archive: Path) -> dict[str, Path]:
    bin_dir = cache_dir(archive) / "bin"
    return {"ztunnel": bin_dir / "ztunnel", "inpodserver": bin_dir / "inpodserver"}


def fake_ca_root_dir(archive: Path) -> Path:
    """ztunnel's ``src/tls``: the test root ``FAKE_CA`` signs with (``root-cert.pem``, key ``ca-key.pem``)."""
    return cache_dir(archive) / "tls"


def cached(archive: Path) -> bool:
    return all(path.is_file() and os.access(path, os.X_OK) for path in binaries(archive).values())


def drop_boring(cargo_toml: Path) -> None:
    """Remove the unreachable git dependency and the feature that needs it."""
    lines = cargo_toml.read_text().splitlines(keepends=True)
    kept = [
        line
        for line in lines
        if not re.match(r"\s*boring-rustls-provider\s*=", line) and not re.match(r"\s*tls-boring\s*=", line)
    ]
    cargo_toml.write_text("".join(kept))


def unpack(archive: Path, work: Path) -> Path:
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    with tarfile.open(archive) as tar:
        tar.extractall(work, filter="data")
    source = work / "ztunnel"
    drop_boring(source / "Cargo.toml")
    return source


def build(archive: Path) -> dict[str, Path]:
    cache = cache_dir(archive)
    source = unpack(archive, cache / "src")
    env = dict(os.environ, CARGO_TARGET_DIR=str(cache / "target"))
    common = ["cargo", "build", "--release", "--no-default-features", "--features", FEATURES]
    started = time.monotonic()
    for extra in ([], ["--example", "inpodserver"]):
        print("+", " ".join(common + extra), file=sys.stderr, flush=True)
        subprocess.run(common + extra, cwd=source, env=env, check=True)
    out = cache / "target" / "release"
    bin_dir = cache / "bin"
    bin_dir.mkdir(exist_ok=True)
    shutil.copy2(out / "ztunnel", bin_dir / "ztunnel")
    shutil.copy2(out / "examples" / "inpodserver", bin_dir / "inpodserver")
    # The test root that FAKE_CA signs with, for ztwisted's plug-in CA.
    shutil.copytree(source / "src" / "tls", fake_ca_root_dir(archive), dirs_exist_ok=True)
    shutil.copytree(source / "examples", cache / "examples", dirs_exist_ok=True)
    minutes = (time.monotonic() - started) / 60
    print(f"ztunnel built in {minutes:.1f} min: {bin_dir}", file=sys.stderr, flush=True)
    return binaries(archive)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--where", action="store_true", help="print the cached binary's path, build nothing")
    parser.add_argument("--archive", type=Path, default=None, help="ztunnel source archive")
    args = parser.parse_args(argv)
    archive = args.archive or default_archive()
    if archive is None or not archive.is_file():
        print("ztunnel_build: no ztunnel-*.tar.gz found (set ZTWISTED_ZTUNNEL_ARCHIVE)", file=sys.stderr)
        return 1
    if not cached(archive):
        if args.where:
            print(f"ztunnel_build: not built yet ({cache_dir(archive)})", file=sys.stderr)
            return 1
        if shutil.which("protoc") is None:
            print("ztunnel_build: protoc is missing (apt-get install protobuf-compiler)", file=sys.stderr)
            return 1
        build(archive)
    print(binaries(archive)["ztunnel"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
