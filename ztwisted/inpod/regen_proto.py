"""Regenerate every ``*_pb2.py`` from its ``.proto`` and compare them with the committed files.

    python ztwisted/inpod/regen_proto.py           # check: exit 1 if any differs
    python ztwisted/inpod/regen_proto.py --write   # overwrite the committed files

Covers ZDS (``ztwisted/inpod/zds.proto``) and the control-plane protocols
(``ztwisted/xds/*.proto``: workloads, authorization, delta xDS, the CA).
Needs ``grpcio-tools`` (its bundled protoc and well-known types); the
generated header names the protobuf version, so the check also fails when a
different protoc is used.
"""

from __future__ import annotations

import argparse
import difflib
import sys
import tempfile
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent
REPO_ROOT = PACKAGE_DIR.parent
PROTOS = (
    PACKAGE_DIR / "inpod" / "zds.proto",
    PACKAGE_DIR / "xds" / "workload.proto",
    PACKAGE_DIR / "xds" / "authorization.proto",
    PACKAGE_DIR / "xds" / "discovery.proto",
    PACKAGE_DIR / "xds" / "ca.proto",
)


def generated_path(proto: Path) -> Path:
    return proto.with_name(proto.stem + "_pb2.py")


def generate(out_dir: Path) -> dict[Path, str]:
    """Run protoc on every proto into ``out_dir``; committed path -> freshly generated text."""
    try:
        from importlib.resources import files

        from grpc_tools import protoc
    except ImportError as exc:
        raise SystemExit("regen_proto needs grpcio-tools: pip install grpcio-tools") from exc
    well_known = files("grpc_tools") / "_proto"
    relative = [str(proto.relative_to(REPO_ROOT)) for proto in PROTOS]
    # The include root is the repository, so descriptors record paths such as
    # "ztwisted/xds/workload.proto" (and imports become package imports)
    # whatever directory this runs from.
    status = protoc.main(["protoc", f"-I{REPO_ROOT}", f"-I{well_known}", f"--python_out={out_dir}", *relative])
    if status != 0:
        raise SystemExit(f"protoc failed with status {status} on {', '.join(relative)}")
    return {
        generated_path(proto): (out_dir / generated_path(proto).relative_to(REPO_ROOT)).read_text() for proto in PROTOS
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="overwrite the committed *_pb2.py files")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ztwisted-proto-") as tmp:
        fresh = generate(Path(tmp))
    if args.write:
        for path, text in fresh.items():
            path.write_text(text)
            print(f"wrote {path}")
        return 0
    stale = []
    for path, text in fresh.items():
        committed = path.read_text() if path.exists() else ""
        if text != committed:
            stale.append(path)
            sys.stdout.writelines(
                difflib.unified_diff(
                    committed.splitlines(keepends=True),
                    text.splitlines(keepends=True),
                    fromfile=f"{path} (committed)",
                    tofile="regenerated",
                )
            )
    if not stale:
        print(f"{len(fresh)} generated modules are up to date with their .proto files")
        return 0
    print(
        f"\n{', '.join(p.name for p in stale)} differ from what the .proto files generate: "
        "run `python ztwisted/inpod/regen_proto.py --write` and commit the result",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
