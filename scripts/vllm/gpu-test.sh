#!/usr/bin/env bash
# kvsp's vLLM connector tests (python/tests_vllm) on a GPU node, where CI
# cannot go: real CUDA vLLM 0.32.0 (FlashAttention's NHD page layout, the
# scatter and gather through device memory), bfloat16, the same engines,
# salts, corrupted block and transfers as make test-vllm on CPU. VENV is a
# virtual environment with vllm==0.32.0 (pip install 'kvsp[vllm]'), pytest
# and transformers; the tiny model is made here as make vllm-check makes it.
#   scripts/vllm/gpu-test.sh VENV
set -euo pipefail
venv=${1:?usage: scripts/vllm/gpu-test.sh VENV}
cd "$(dirname "$0")/../.."
test -x bin/kvsp || make build
test -f bin/vllm-tiny/config.json || "$venv/bin/python" scripts/vllm/tiny_model.py bin/vllm-tiny
cd python
PYTHONPATH="$PWD/src" KVSP_BIN="$PWD/../bin/kvsp" HF_HUB_OFFLINE=1 KVSP_VLLM_DTYPE=bfloat16 \
	"$venv/bin/pytest" tests_vllm -p no:cacheprovider
