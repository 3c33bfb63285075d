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
exit $status
