#!/usr/bin/env bash
# Runs every fuzz target of the module for FUZZTIME each, one after the
# other (go test -fuzz takes one target at a time), like etcd's
# scripts/fuzzing.sh. Failing inputs land in each package's testdata/fuzz.
set -euo pipefail
GO=${GO:-go}
FUZZTIME=${FUZZTIME:-10s}
cd "$(dirname "$0")/.."
status=0
for pkg in $($GO list ./...); do
	for target in $($GO test -tags nogpu -list '^Fuzz' "$pkg" | grep '^Fuzz' || true); do
		echo "== $pkg $target ($FUZZTIME)"
		if ! $GO test -tags nogpu -run '^$' -fuzz "^${target}\$" -fuzztime "$FUZZTIME" "$pkg"; then
			status=1
		fi
	done
done
exit $status
