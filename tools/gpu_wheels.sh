#!/usr/bin/env bash
# The wheels tools/gpu_check.sh installs on the GPU machine, which reaches no package index: DeepSpeed as it is
# installed here (built with DS_BUILD_OPS=0: pure Python, its ops left to JIT) and the packages it needs, at the
# versions installed here, for the GPU machine's Python. Run it on this side before a lent session's first device
# call, then carry the directory:
#
#   bash tools/gpu_wheels.sh ["PYTHON_VERSIONS"] [DIR]   # default: "3.11 3.12 3.13" (the lent H100 had 3.12) and .whl
#
# tools/gpu_check.sh installs deepspeed from DIR with pip's resolver (--no-index --find-links), which takes the
# wheels that fit the machine's Python and what it already has.
#
# .whl/ is ignored by git; name it in the device call's `carry` (about 8 MB). The GPU image had torch, numpy and
# transformers (2026-11-22); every other package DeepSpeed needs is here. Needs a package index (pip download).
set -euo pipefail
cd "$(dirname "$0")/.."
PYVS=${1:-3.11 3.12 3.13}
DIR=${2:-.whl}
PY=${PYTHON:-python3}
mkdir -p "$DIR"
DS=$($PY -c "import importlib.metadata as m; print(m.version('deepspeed'))")
echo "[gpu_wheels] deepspeed $DS for python $PYVS into $DIR"
DS_BUILD_OPS=0 $PY -m pip wheel -q --no-deps --no-build-isolation -w "$DIR" "deepspeed==$DS"
# shellcheck disable=SC2207
pins=($($PY -c "import importlib.metadata as m, sys; print(*(f'{p}=={m.version(p)}' for p in sys.argv[1:]))" \
  pydantic pydantic_core annotated-types typing-inspection hjson einops msgpack ninja py-cpuinfo psutil tqdm packaging))
for pyv in $PYVS; do
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version "$pyv" --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    -d "$DIR" "${pins[@]}"
done
ls -1 "$DIR"
du -sh "$DIR"
