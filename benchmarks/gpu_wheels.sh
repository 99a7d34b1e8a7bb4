#!/usr/bin/env bash
# Wheels for the GPU machine, which has no internet (README: "A GPU session"), into .whl/ (ignored
# by git; carried to the machine with each call). DeepSpeed publishes only a source archive; with
# DS_BUILD_OPS=0 it builds here as a pure-Python wheel (py3-none-any), and its C++/CUDA ops
# (CPU Adam among them) compile just-in-time on the GPU machine, whose image has nvcc and ninja.
# Its requirements that the GPU image lacks (hjson, pydantic and pydantic's own) come as wheels
# for that machine's Python. Run it from the project's virtual environment: building DeepSpeed's
# wheel imports torch (the local CPU build is enough).
#
#   bash benchmarks/gpu_wheels.sh [DEEPSPEED_VERSION] [PYTHON_VERSION]     # defaults: 0.19.8 3.12
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:-0.19.8}"
python_version="${2:-3.12}"
src="$(mktemp -d)"
trap 'rm -rf "$src"' EXIT
mkdir -p .whl
rm -f .whl/deepspeed-*.whl
pip download -q --no-deps --no-binary :all: -d "$src" "deepspeed==$version"
DS_BUILD_OPS=0 pip wheel -q --no-deps --no-build-isolation -w .whl "$src/deepspeed-$version.tar.gz"
pip download -q --no-deps --only-binary=:all: --python-version "$python_version" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl hjson pydantic pydantic-core annotated-types typing-inspection typing-extensions
# bitsandbytes for the rows with 8-bit Adam moments (43 MB: with the rest, under the 64 MiB a call carries).
pip download -q --no-deps --only-binary=:all: --python-version "$python_version" --implementation cp \
    --platform manylinux_2_24_x86_64 -d .whl "bitsandbytes==0.50.2"
ls -1 .whl
