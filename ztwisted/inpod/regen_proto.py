"""Regenerate ``zds_pb2.py`` from ``zds.proto`` and compare it with the committed file.

    python ztwisted/inpod/regen_proto.py           # check: exit 1 if they differ
    python ztwisted/inpod/regen_proto.py --write   # overwrite the committed file

Needs ``grpcio-tools`` (its bundled protoc); the generated header names the
protobuf version, so the check also fails when a different protoc is used.
"""

from __future__ import annotations

import argparse
import difflib
import sys
import tempfile
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parent.parent
PROTO = PACKAGE_DIR / "zds.proto"
GENERATED = PACKAGE_DIR / "zds_pb2.py"


def generate(out_dir: Path) -> Path:
    """Run protoc on zds.proto into ``out_dir``; returns the generated file's path."""
    try:
        from grpc_tools import protoc
    except ImportError as exc:
        raise SystemExit("regen_proto needs grpcio-tools: pip install grpcio-tools") from exc
    relative = PROTO.relative_to(REPO_ROOT)
    # The include root is the repository, so the descriptor records
    # "ztwisted/inpod/zds.proto" whatever directory this runs from.
    status = protoc.main(["protoc", f"-I{REPO_ROOT}", f"--python_out={out_dir}", str(relative)])
    if status != 0:
        raise SystemExit(f"protoc failed with status {status} on {PROTO}")
    return out_dir / relative.with_name("zds_pb2.py")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="overwrite the committed zds_pb2.py")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="zds-proto-") as tmp:
        fresh = generate(Path(tmp)).read_text()
    if args.write:
        GENERATED.write_text(fresh)
        print(f"wrote {GENERATED}")
        return 0
    committed = GENERATED.read_text() if GENERATED.exists() else ""
    if fresh == committed:
        print(f"{GENERATED.name} is up to date with {PROTO.name}")
        return 0
    sys.stdout.writelines(difflib.unified_diff(
        committed.splitlines(keepends=True), fresh.splitlines(keepends=True),
        fromfile=f"{GENERATED} (committed)", tofile="regenerated"))
    print(f"\n{GENERATED.name} differs from what {PROTO.name} generates: "
          "run `python ztwisted/inpod/regen_proto.py --write` and commit the result", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
