# The two commands a newcomer needs: `make serve` and `make test`.
# Each creates the virtual environment if it is missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is pinned on purpose: an unpinned torch may pull several GB of CUDA wheels.
# Where a CUDA build of torch is already installed system-wide, set TORCH_SPEC= to skip it.
TORCH_SPEC ?= torch==2.13.0
SOCKET ?= /tmp/memory-broker.sock
SERVE_ARGS ?=

.PHONY: serve test venv proto proto-check bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(if $(TORCH_SPEC),$(PY) -m pip install -q "$(TORCH_SPEC)")
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

venv: $(VENV)/.installed

serve: venv
	$(VENV)/bin/memory-broker serve --socket $(SOCKET) $(SERVE_ARGS)

test: venv proto-check
	$(PY) -m pytest -q

# Regenerate broker/v1/*_pb2*.py from proto/. Generated code is committed.
proto: venv
	$(PY) -m grpc_tools.protoc -I proto --python_out=. --pyi_out=. --grpc_python_out=. proto/broker/v1/*.proto

# Fails when the committed generated code is stale.
proto-check: venv
	@tmp=$$(mktemp -d) && \
	$(PY) -m grpc_tools.protoc -I proto --python_out=$$tmp --pyi_out=$$tmp --grpc_python_out=$$tmp proto/broker/v1/*.proto && \
	if diff -r -x __init__.py -x __pycache__ $$tmp/broker/v1 broker/v1 >/dev/null; then rm -rf $$tmp; echo "generated code is up to date"; \
	else diff -r -x __init__.py -x __pycache__ $$tmp/broker/v1 broker/v1 | head -20; rm -rf $$tmp; echo "generated code is stale: run 'make proto' and commit"; exit 1; fi

bench: venv
	$(PY) ops/bench/bench_core.py
	$(PY) ops/bench/bench_rpc.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
