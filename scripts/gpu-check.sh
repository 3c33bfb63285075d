#!/usr/bin/env bash
# The GPU check: runs the stripped test binaries that `make test-gpu` built
# on a machine with an NVIDIA GPU and no Go toolchain, in at most about 4
# minutes, and prints the benchmark table. KVSP_REQUIRE_GPU=1 makes a
# missing device a failure, not a skip.
set -uo pipefail
cd "$(dirname "$0")"
export KVSP_REQUIRE_GPU=1
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,pcie.link.width.max --format=csv 2>/dev/null || echo "nvidia-smi: not available"
status=0
echo "== tests"
timeout 60 ./gpu.test -test.v -test.run '.' -test.count 1 || status=1
echo "== benchmarks (ratios are to the plain driver copy of the same sizes, same run)"
timeout 120 ./gpu.test -test.run '^$' -test.bench '.' -test.benchtime 2x -test.count 1 -test.benchmem || status=1
echo "== device-tier GET over TLS (GB/s, cpu-s/GB; the SHA-256 bound of the verifying client)"
timeout 60 ./holder.test -test.run '^$' -test.bench 'DeviceGet' -test.benchtime 200x -test.count 1 || status=1
echo "== the Python attach client: a cuda-ipc pool served by the holder (pytest -m gpu)"
if python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
	gunzip -kf py/bin/kvsp.gz && v=$(mktemp -d) && python3 -m venv "$v" && "$v/bin/pip" install -q --no-index --find-links py/wheels kvsp pytest &&
		(cd py/python && KVSP_BIN=../bin/kvsp timeout 120 "$v/bin/python" -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_attach.py) || status=1
else
	echo "python3 3.11 or later is missing: the Python GPU test did not run"; status=1
fi
exit $status
