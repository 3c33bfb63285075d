#!/usr/bin/env bash
# Makes Debian's contrib and non-free components available to apt (a
# deb822 source on the same mirror and keyring as the machine's), when
# package $1 has no installable version yet (apt-cache show succeeds for a
# package that is only referenced, with no candidate: madison lists real
# versions). Used by the CUDA build scripts.
set -euo pipefail
if [ -z "$(apt-cache madison "$1" 2>/dev/null)" ]; then
	cat >/etc/apt/sources.list.d/kvsp-nonfree.sources <<SRC
Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm
Components: contrib non-free
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
	apt-get update -qq >&2
fi
