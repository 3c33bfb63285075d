#!/usr/bin/env bash
# Makes sure nvcc (CUDA 11.8, Debian non-free's nvidia-cuda-toolkit) is
# installed, adding the non-free apt source when missing; prints its path.
# The committed PTX is what this nvcc makes: nvcc's output is reproducible.
set -euo pipefail
if ! command -v nvcc >/dev/null; then
	if ! apt-cache show nvidia-cuda-toolkit >/dev/null 2>&1; then
		cat >/etc/apt/sources.list.d/kvsp-nonfree.sources <<SRC
Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm
Components: contrib non-free
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
		apt-get update -qq >&2
	fi
	echo "installing nvidia-cuda-toolkit (nvcc) from Debian non-free" >&2
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nvidia-cuda-toolkit >/dev/null
fi
command -v nvcc
