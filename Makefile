# Two entry points for a fresh machine: `make example` and `make test`.
# Each creates .venv when missing and installs only what is not installed yet.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
TORCH_STAMP := $(VENV)/.torch-2.13.0
DEPS_STAMP := $(VENV)/.deps-installed

.PHONY: test test-fast example scaling scaling-quick upcycling upcycling-quick install wheelhouse clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# The CPU build of torch that lies on this disk; installing it first keeps pip from
# pulling a CUDA build for the torch requirement of the other packages.
$(TORCH_STAMP): | $(PY)
	$(PIP) install -q torch==2.13.0
	touch $@

$(DEPS_STAMP): setup.py $(TORCH_STAMP)
	DS_BUILD_OPS=0 $(PIP) install -q -e ".[test,hf]"
	touch $@

install: $(DEPS_STAMP)

test: $(DEPS_STAMP)
	$(PY) -m pytest -q --durations=15 tests

# The edit-test loop: every test but those marked slow (ranks through the deepspeed launcher or spawned).
test-fast: $(DEPS_STAMP)
	$(PY) -m pytest -q -m "not slow" --durations=10 tests

# Every wheel that installs the plugin where a CUDA torch is installed and there is no network (no torch,
# no NVIDIA library): wheelhouse/, for Python 3.11 and 3.12; examples/gpt_moe/install_wheels.sh installs it.
WHEELHOUSE ?= wheelhouse
wheelhouse: $(DEPS_STAMP)
	$(PY) -m moe_plugin_tools.wheelhouse --out $(WHEELHOUSE)

# The GPT-MoE training example: a byte-level Megatron-Core GPT with MoE layers (8 experts, EP 2
# carved out of DP 4 on 4 CPU ranks, ZeRO-1), trained by the DeepSpeed engine on the Python
# stdlib (written to data/ on first use); see examples/gpt_moe/README.md. The launcher needs
# .venv/bin on PATH to start the ranks with the venv's python.
EXAMPLE_RUN := runs/tiny_cpu_4rank
example: $(DEPS_STAMP)
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH examples/gpt_moe/run_tiny_cpu.sh --run-dir $(EXAMPLE_RUN)
	@echo
	@echo "metrics: $(CURDIR)/$(EXAMPLE_RUN)/metrics.jsonl"
	@echo "plot:    $(CURDIR)/$(EXAMPLE_RUN)/metrics.png"
	@echo "config:  $(CURDIR)/$(EXAMPLE_RUN)/run.json"

# The scaling study (examples/gpt_moe/scaling): dense vs 4-32 experts, top-2 and top-1, at the
# same compute per token; runs/scaling/report.md and plots. --quick: the same machinery in minutes.
scaling: $(DEPS_STAMP)
	$(PY) examples/gpt_moe/scaling/study.py

scaling-quick: $(DEPS_STAMP)
	$(PY) examples/gpt_moe/scaling/study.py --quick

# The upcycling study (examples/gpt_moe/scaling/upcycling.py): the dense model trained half-way, then
# continued dense, upcycled to 8 experts top-2, or the 8-expert model from scratch; runs/upcycling/.
upcycling: $(DEPS_STAMP)
	$(PY) examples/gpt_moe/scaling/upcycling.py

upcycling-quick: $(DEPS_STAMP)
	$(PY) examples/gpt_moe/scaling/upcycling.py --quick

clean:
	rm -rf $(VENV) *.egg-info $(WHEELHOUSE)
