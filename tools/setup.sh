#!/usr/bin/env bash
# Set up a fresh machine for pretrain: system packages (when root), CPU torch pinned first so no
# dependency pulls a CUDA build, then the package itself (editable) with the hf extra (transformers +
# sentence-transformers, to load exports) or, with --test, the test extras.
#   bash tools/setup.sh          # what the quickstart needs
#   bash tools/setup.sh --test   # + what the test suite needs (Slurm + munge for the real-cluster tests)
set -euo pipefail
cd "$(dirname "$0")/.."
want_test=0
[ "${1:-}" = "--test" ] && want_test=1

pkgs=(wordnet-base)
[ "$want_test" = 1 ] && pkgs+=(slurm-wlm munge)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "[setup] apt-get install ${missing[*]}"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "[setup] warning: missing system packages ${missing[*]} (need root/apt); synonym substitution" \
         "and the Slurm tests will be skipped or fail" >&2
  fi
fi

PY=${PYTHON:-python3}
# Users on GPU clusters bring their own CUDA torch; here pin the CPU build first.
if ! $PY -c "import torch" >/dev/null 2>&1; then
  $PY -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
fi
extras="hf"
[ "$want_test" = 1 ] && extras="dev"
$PY -m pip install -q -e ".[${extras}]"
echo "[setup] done: $($PY -c 'import torch, deepspeed; print("torch", torch.__version__, "deepspeed", deepspeed.__version__)' 2>/dev/null | tail -1)"
