# Two entry points for a fresh machine: `make example` and `make test`.
# Each creates .venv when missing and installs only what is not installed yet.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
TORCH_STAMP := $(VENV)/.torch-2.13.0
DEPS_STAMP := $(VENV)/.deps-installed

.PHONY: test example install clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# The CPU build of torch that lies on this disk; installing it first keeps pip from
# pulling a CUDA build for the torch requirement of the other packages.
$(TORCH_STAMP): | $(PY)
	$(PIP) install -q torch==2.13.0
	touch $@

$(DEPS_STAMP): setup.py $(TORCH_STAMP)
	DS_BUILD_OPS=0 $(PIP) install -q -e ".[test]"
	touch $@

install: $(DEPS_STAMP)

test: $(DEPS_STAMP)
	$(PY) -m pytest -q tests

example: $(DEPS_STAMP)
	$(VENV)/bin/moe-plugin demo --world-size 4

clean:
	rm -rf $(VENV) *.egg-info
