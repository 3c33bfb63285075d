#!/usr/bin/env bash
# Installs the pinned llama.cpp shared libraries into $1 (default
# .cache/llama.cpp): npm's @node-llama-cpp/linux-x64@3.21.1, which ships
# llama.cpp v0.4.0 built for the CPU. The tarball's sha512 is checked
# before anything is unpacked; engine/llamacpp checks each library's
# sha256 and SONAME again when it loads them. Nothing of llama.cpp is
# committed.
set -euo pipefail
PKG="@node-llama-cpp/linux-x64@3.21.1"
SHA512="Totj6RTDMGo3FoK2yNUaz/oGmZD0olAqTrRluFUWmu0kW2i9TOzHSW0OWCAiGkzRCVX0WsU2CyUQo/W2NYtdPA=="
DIR="${1:-.cache/llama.cpp}"
STAMP="$DIR/.installed-node-llama-cpp-linux-x64-3.21.1"
[ -f "$STAMP" ] && exit 0
command -v npm >/dev/null || { echo "llama-deps: npm is needed to fetch $PKG (apt-get install npm)" >&2; exit 1; }
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
echo "fetching $PKG"
(cd "$tmp" && npm pack --silent "$PKG" >/dev/null)
tgz="$tmp/node-llama-cpp-linux-x64-3.21.1.tgz"
got="$(openssl dgst -sha512 -binary "$tgz" | base64 -w0)"
if [ "$got" != "$SHA512" ]; then
	echo "llama-deps: $PKG has sha512 $got, not the pinned $SHA512" >&2
	exit 1
fi
tar -xzf "$tgz" -C "$tmp" package/bins/linux-x64
mkdir -p "$DIR"
rm -f "$DIR"/*.so
cp "$tmp"/package/bins/linux-x64/libllama.v0.4.0.so "$tmp"/package/bins/linux-x64/libggml.v0.4.0.so "$tmp"/package/bins/linux-x64/libggml-base.so "$tmp"/package/bins/linux-x64/libggml-cpu-*.so "$DIR"/
# The binding opens the unversioned names.
ln -sf libllama.v0.4.0.so "$DIR/libllama.so"
ln -sf libggml.v0.4.0.so "$DIR/libggml.so"
touch "$STAMP"
echo "llama.cpp v0.4.0 in $DIR"
