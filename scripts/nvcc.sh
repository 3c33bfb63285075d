#!/usr/bin/env bash
# Makes sure nvcc (CUDA 11.8, Debian non-free's nvidia-cuda-toolkit) is
# installed, adding the non-free apt source when missing; prints its path.
# The committed PTX is what this nvcc makes: nvcc's output is reproducible.
set -euo pipefail
if ! command -v nvcc >/dev/null; then
	"$(dirname "$0")/nonfree-apt.sh" nvidia-cuda-toolkit
	echo "installing nvidia-cuda-toolkit (nvcc) from Debian non-free" >&2
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nvidia-cuda-toolkit >/dev/null
fi
command -v nvcc
