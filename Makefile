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

# Until the GPT-MoE training example lands: the resolved layout of the 4-rank example job,
# then the same job launched on 4 real ranks, its groups read back through Megatron's and
# DeepSpeed's getters.
example: $(DEPS_STAMP)
	$(VENV)/bin/moe-plugin demo --world-size 4
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(VENV)/bin/deepspeed --num_gpus 4 examples/gpt_moe/show_groups.py \
		--deepspeed_config examples/gpt_moe/configs/tiny_cpu_4rank.json

clean:
	rm -rf $(VENV) *.egg-info
