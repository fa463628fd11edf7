"""Regenerate the Python code for protos/streamdiloco.proto (run after editing the .proto).

python protos/generate.py           # writes streamdiloco_pb2.py, _pb2.pyi, _pb2_grpc.py next to it
python protos/generate.py --check   # exit 1 if the committed code differs from what would be generated
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO = "streamdiloco.proto"
OUTPUTS = ("streamdiloco_pb2.py", "streamdiloco_pb2.pyi", "streamdiloco_pb2_grpc.py")


def generate(out: Path) -> None:
    from grpc_tools import protoc  # grpcio-tools, pinned to grpcio's version in constraints.txt

    args = [
        "protoc",
        f"-I{HERE}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        str(HERE / PROTO),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    # grpc_tools writes `import streamdiloco_pb2`; inside the package it must be a relative import
    grpc_file = out / "streamdiloco_pb2_grpc.py"
    text = grpc_file.read_text()
    grpc_file.write_text(text.replace("import streamdiloco_pb2 as", "from . import streamdiloco_pb2 as"))


def stale_files() -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        return [
            name
            for name in OUTPUTS
            if not (HERE / name).exists() or (HERE / name).read_text() != (Path(tmp) / name).read_text()
        ]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--check", action="store_true", help="only report whether the committed code is stale"
    )
    args = parser.parse_args()
    if args.check:
        stale = stale_files()
        if stale:
            print(f"stale generated code: {', '.join(stale)}; run `python protos/generate.py`")
            return 1
        print("generated code is up to date")
        return 0
    generate(HERE)
    print(f"wrote {', '.join(OUTPUTS)} in {HERE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
