# make lab   : set up .venv and run the lab end to end on this machine's default profile
# make test  : set up .venv with the test extras and run the whole suite
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Without an NVIDIA GPU, pin the CPU build of torch (and its Triton) through a constraints file;
# with one, torch stays as pyproject leaves it (unpinned).
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
CONSTRAINTS := $(if $(HAS_GPU),,-c constraints/cpu.txt)
DEPS := pyproject.toml constraints/cpu.txt

.PHONY: lab test venv clean-venv

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(VENV)/.lab-installed: $(PY) $(DEPS)
	$(PY) -m pip install -q $(CONSTRAINTS) -e .
	touch $@

$(VENV)/.test-installed: $(PY) $(DEPS)
	$(PY) -m pip install -q $(CONSTRAINTS) -e '.[test]'
	touch $@ $(VENV)/.lab-installed

venv: $(VENV)/.lab-installed

lab: $(VENV)/.lab-installed
	$(VENV)/bin/labkit run

test: $(VENV)/.test-installed
	MPLBACKEND=agg $(PY) -m pytest

clean-venv:
	rm -rf $(VENV)
