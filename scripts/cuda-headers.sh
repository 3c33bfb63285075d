#!/usr/bin/env bash
# Prints the directory holding the CUDA driver API headers (cuda.h), after
# fetching them when needed: the system's (/usr/include/cuda.h, from
# Debian's nvidia-cuda-dev) if present, otherwise extracted into
# .cache/cuda from the nvidia-cuda-dev package of Debian non-free, which
# is added to the apt sources (deb822) when missing. Only the headers are
# extracted: none of the package's 2.8 GB of libraries is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f /usr/include/cuda.h ]; then
	echo /usr/include
	exit 0
fi
dir=.cache/cuda
if [ ! -f "$dir/usr/include/cuda.h" ]; then
	"$(dirname "$0")/nonfree-apt.sh" nvidia-cuda-dev
	tmp=$(mktemp -d)
	chmod 755 "$tmp" # apt downloads as _apt
	(cd "$tmp" && apt-get download -qq nvidia-cuda-dev >&2)
	mkdir -p "$dir"
	dpkg-deb --fsys-tarfile "$tmp"/nvidia-cuda-dev_*.deb | tar -x -C "$dir" ./usr/include/cuda.h ./usr/include/cudaTypedefs.h
	rm -rf "$tmp"
fi
echo "${PWD}/$dir/usr/include"
